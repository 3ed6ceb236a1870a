"""A stop raised from a signal handler (rlslurm/lifetime.py StopFlag): a node agent hit by a burst of SIGTERMs ends.

With a threading.Event there, the handler of a second SIGTERM could run inside the first handler's Event.set (or
inside the main thread's own Event.wait) and wait for the Event's lock for good: 2 of 10 agents hung under the burst
below, and bench/run_all.py's requeue bench left one running with its run directory gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from rlslurm.lifetime import StopFlag
from rlslurm.rundir import RunDir


def test_the_flag_waits_like_an_event():
    flag = StopFlag(poll_s=0.01)
    t0 = time.monotonic()
    assert flag.wait(0.05) is False and time.monotonic() - t0 >= 0.05 and not flag.is_set()
    threading.Timer(0.05, flag.set).start()
    assert flag.wait(5) is True and flag.is_set() and time.monotonic() - t0 < 2
    assert flag.wait(0) is True and flag.wait() is True


def test_a_node_agent_ends_under_a_burst_of_sigterms(tmp_path):
    hung, codes = [], []
    for trial in range(10):
        run = RunDir(tmp_path / f"run{trial}").create()
        agent = subprocess.Popen([sys.executable, "-m", "rlslurm.diag.watchdog", "--run-dir", str(run.path),
                                  "--parent-pid", "0", "--watch-interval-s", "0.05"], stderr=subprocess.PIPE, text=True)
        try:
            assert "watching heartbeats" in agent.stderr.readline()  # its handlers are in place
            for _ in range(200):
                try:
                    os.kill(agent.pid, signal.SIGTERM)
                except ProcessLookupError:
                    break
            codes.append(agent.wait(10))
        except subprocess.TimeoutExpired:
            hung.append(trial)
        finally:
            agent.kill()
            agent.wait()
    assert hung == [] and codes == [0] * 10  # each left its watch cleanly ("asked to stop")
