"""The cpu profile's hardware.hbm_gb is a real cap (rlslurm/memcap.py): a rank past it is killed as a GPU's would
be, a shape the plan calls OOM is refused before anything runs, and a shape it calls ok runs under the cap.

    python -m pytest -q tests/integration/test_memory_cap.py     # root (a memory cgroup is made); ~1 min
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import failures
from rlslurm import events
from rlslurm.cli.main import cli
from rlslurm.memcap import PREFIX, _memory_cgroup
from rlslurm.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
GROW = """
import sys
from rlslurm.memcap import cap_process
how = cap_process(0.2, stale=sys.argv[2:])
assert how["capped"], how
import numpy
block = numpy.ones(int(float(sys.argv[1]) * 1e9 / 8))
print("held", block.nbytes)
"""


def _group(pid: int) -> Path:
    found = _memory_cgroup()
    assert found is not None
    return found[0] / f"{PREFIX}{pid}"


def _grow(*args: str) -> tuple[int, int, str]:
    """(pid, exit code, stdout) of GROW run with `args`."""
    p = subprocess.Popen([sys.executable, "-c", GROW, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    out, _ = p.communicate(timeout=120)
    return p.pid, p.returncode, out


def test_a_process_past_its_cap_is_killed_and_one_under_it_runs(tmp_path):
    if _memory_cgroup() is None:
        pytest.fail("no memory cgroup is mounted: the cpu profile's cap cannot be enforced here")
    pid, code, out = _grow("0.1")
    assert code == 0 and "held 100000000" in out and not _group(pid).exists()  # a clean exit removes its own
    pid, code, _ = _grow("0.4")
    assert code == -9, code  # the kernel's OOM killer: SIGKILL
    killed = _group(pid)
    assert killed.is_dir() and "oom_kill 1" in (killed / ("memory.events" if (killed / "memory.events").exists()
                                                          else "memory.oom_control")).read_text().splitlines()
    # The killed one's cgroup stays (the kernel's evidence) until a process of its run caps itself again.
    pid, code, _ = _grow("0.01", str(killed))
    assert code == 0 and not killed.exists() and not _group(pid).exists()


def _sft(tmp_path: Path, *sets: str) -> list[str]:
    return ["--set", "train.steps=6", "--set", "train.warmup_steps=0", "--set", "train.stop_at_accuracy=null",
            "--set", "checkpoint.interval_steps=100",
            "--set", f"cluster.run_root={tmp_path / 'runs'}", *(a for s in sets for a in ("--set", s))]


CHILD = """
import subprocess, sys
from rlslurm.memcap import cap_process
how = cap_process(0.2)
assert how["capped"], how
child = "import rlslurm; print(open('/proc/self/cgroup').read())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
"""


def test_what_a_capped_rank_starts_is_not_in_its_cap(tmp_path):
    """An engine or the reward service a capped rank starts leaves the rank's cgroup first thing (rlslurm/__init__)."""
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "memory" in p.stdout or "0::/" in p.stdout, p.stdout  # the child's own /proc/self/cgroup, read
    assert PREFIX not in p.stdout, p.stdout


def test_a_shape_the_plan_calls_ok_runs_under_the_cap_and_one_it_calls_oom_is_refused(tmp_path):
    sft = str(ROOT / "examples" / "tiny-sft.yaml")
    # 32k vocabulary (the embedded tokenizer uses 28 of them): the logits of 32 x 11 tokens are 45 MB a copy
    oom = ("model.vocab=32000", "hardware.hbm_gb=0.1")
    refused = CliRunner().invoke(cli, ["submit", sft, "--backend", "local", *_sft(tmp_path, *oom)])
    assert refused.exit_code == 3 and "trainer OOM" in refused.output, refused.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())

    ok = ("hardware.hbm_gb=0.25",)  # the tiny model's plan: ~20 MB
    sub = failures.submit(Path(sft), tmp_path / "runs", tuple(_sft(tmp_path, *ok)[1::2]))
    assert failures.ended(sub) == "ok"
    capped = events.read_events(RunDir(sub.run_dir), events.MEMORY_CAPPED)
    assert sorted(e["rank"] for e in capped) == [0, 1] and all(e["capped"] and e["cap_gb"] == 0.25 for e in capped)


def test_a_rank_forced_past_the_plans_oom_verdict_is_killed_by_the_cap(tmp_path):
    """--force past the plan's OOM: a rank's first step passes 0.1 GB and the kernel kills it in its cgroup; the
    node agent reads the cgroup's own oom_kill count into `rank_died` (the rank died before the agent's first
    look: it finds it from `memory_capped`), removes the cgroup, and `rlslurm diag` names the OOM."""
    sft = ROOT / "examples" / "tiny-sft.yaml"
    sets = tuple(_sft(tmp_path, "model.vocab=32000", "hardware.hbm_gb=0.1", "train.max_restarts=0")[1::2])
    sub = failures.submit(sft, tmp_path / "runs", sets, force=True)
    assert failures.ended(sub) != "ok"
    capped = events.read_events(RunDir(sub.run_dir), events.MEMORY_CAPPED)
    assert len(capped) == 2 and all(e["capped"] for e in capped)
    died = events.read_events(RunDir(sub.run_dir), events.RANK_DIED)
    assert any(d["oom_killed"] and d["cgroup_oom_kills"] >= 1 for d in died), died
    assert {d["rank_pid"] for d in died} <= {e["pid"] for e in capped}
    assert not any(Path(e["cgroup"]).exists() for e in capped)  # the agent removed what it read
    diag = CliRunner().invoke(cli, ["diag", str(sub.run_dir), "--out", str(tmp_path), "--no-slurm"])
    assert diag.exit_code == 0 and "OOM" in diag.output, diag.output
