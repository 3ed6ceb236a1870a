"""Stack dumps of real processes (py-spy, nonblocking for stopped ones, faulthandler) and their reading."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlslurm.diag.stack_dump import collective_in, dump_stack, frames, top_frame

PROGRAM = """
import sys, time
from rlslurm.diag.stack_dump import register_faulthandler
from pathlib import Path
register_faulthandler(Path(sys.argv[1]))
def waiting_for_godot():
    time.sleep(60)
print("ready", flush=True)
waiting_for_godot()
"""


@pytest.fixture
def proc(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path / "fh.txt")], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    yield p
    os.kill(p.pid, signal.SIGCONT)
    p.kill()
    p.wait()


def test_py_spy_dump_shows_the_python_function(proc):
    d = dump_stack(proc.pid, native=True)
    assert d.method in ("py-spy --native", "py-spy") and "waiting_for_godot" in d.text
    assert top_frame(d.text).startswith("waiting_for_godot (<string>:")
    assert collective_in(d.text) is None


def test_stopped_process_is_dumped_without_pausing(proc):
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.1)
    d = dump_stack(proc.pid)
    assert d.state == "stopped" and d.method == "py-spy --nonblocking"
    assert "waiting_for_godot" in d.text


def test_faulthandler_fallback_when_py_spy_is_not_used(proc, tmp_path):
    d = dump_stack(proc.pid, use_py_spy=False, faulthandler_file=tmp_path / "fh.txt", timeout_s=10)
    assert d.method == "faulthandler" and "waiting_for_godot" in d.text
    assert proc.poll() is None  # SIGURG dumped the stacks and did not kill


def test_collective_is_read_from_py_spy_and_faulthandler_text():
    py_spy = """Thread 11743 (idle): "MainThread"
    pthread_cond_wait (libc.so.6)
    c10d::Work::wait (libtorch_cpu.so)
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    train_step (jobs/toytrain.py:55)
"""
    fh = """Current thread 0x00007f (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 4800 in barrier
  File "/work/jobs/toytrain.py", line 90 in main
"""
    assert collective_in(py_spy) == "all_reduce" and collective_in(fh) == "barrier"
    assert top_frame(fh) == "barrier (/venv/torch/distributed/distributed_c10d.py:4800)"
    assert frames(py_spy)[2] == ("all_reduce", "torch/distributed/distributed_c10d.py", "3252")
    assert collective_in("    gloo::transport::tcp::Pair::recv (libgloo.so)\n") == "collective"
    assert collective_in("    broadcast (mylib/radio.py:3)\n") is None  # not torch.distributed's


def test_ddp_gradient_wait_reads_as_all_reduce():
    """DDP all-reduces gradients from C++ inside backward(): only native frames show it (py-spy --native)."""
    ddp = """Thread 29976 (idle): "MainThread"
    pthread_cond_wait (libc.so.6)
    std::condition_variable::wait (libstdc++.so.6.0.30)
    c10d::Reducer::finalize_backward (libtorch_cpu.so)
    torch::autograd::Engine::execute (libtorch_cpu.so)
    _engine_run_backward (torch/autograd/graph.py:979)
    backward (torch/autograd/__init__.py:395)
    Tensor.backward (torch/_tensor.py:623)
    ToyTrainer.step (jobs/toytrain.py:159)
"""
    assert collective_in(ddp) == "all_reduce"
    assert top_frame(ddp) == "_engine_run_backward (torch/autograd/graph.py:979)"
    assert collective_in("    gloo::AllreduceRing<float>::run (libtorch_cpu.so)\n") == "all_reduce"
