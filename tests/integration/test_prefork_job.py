"""The local backend's ranks forked from the supervisor that imported torch and transformers once, and rank 0's
first engine forked from rank 0 (rlslurm/prefork.py, issue 36): the demo's GRPO from the session's SFT export, as
`rlslurm submit --backend local` runs it by default, and with RLSLURM_PREFORK=0 (each a fresh interpreter).

    python -m pytest -q tests/integration/test_prefork_job.py      # ~40 s on 2 cores (two short runs)
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psutil
import pytest

from procs import run_processes
from rl_runs import steps, submit_example
from rlslurm.rundir import read_jsonl

FORKED = re.compile(r"rlslurm\.prefork: pid (\d+) runs (\S+), forked from pid (\d+)")


class _Watch:
    """The run's processes while it runs: pid -> (parent pid, each command line it showed, in order)."""

    def __init__(self, root: Path):
        self.root, self.seen, self._stop = root, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(0.2):
            for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
                line = " ".join(p.info["cmdline"] or [])
                if str(self.root) in line:
                    parent, lines = self.seen.setdefault(p.info["pid"], (p.info["ppid"], []))
                    if line not in lines:
                        lines.append(line)


def _forks(run_dir: Path) -> dict[str, tuple[int, int]]:
    """module -> (pid, parent pid) of each forked process, from the line each writes first in its log."""
    out = {}
    for log in [*(run_dir / "logs" / "submitit").glob("*_log.err"), run_dir / "logs" / "engine-0.log"]:
        for pid, module, parent in FORKED.findall(log.read_text()):
            out.setdefault(f"{module}:{log.name}", (int(pid), int(parent)))
    return out


def test_the_ranks_and_the_first_engine_are_forks_and_leave_nothing_behind(sft, tmp_path):
    with _Watch(tmp_path) as watch:
        _, run_dir = submit_example("tiny-grpo.yaml", tmp_path, (f"train.init_from={sft['export']}", "train.steps=4",
                                                                  "rl.eval_every=100"))
    assert len(steps(run_dir)) == 4
    supervisor_log = (run_dir / "logs" / "local-supervisor.log").read_text()
    assert re.search(r"imported torch and transformers in [\d.]+ s: the ranks are forked", supervisor_log)
    forks = _forks(run_dir)
    ranks = {k: v for k, v in forks.items() if k.startswith("submitit.core._submit:")}
    (engine,) = [v for k, v in forks.items() if k.startswith("rlslurm.rollout.server:")]
    assert len(ranks) == 2 and len({parent for _, parent in ranks.values()}) == 1  # both from the supervisor
    rank0 = next(pid for k, (pid, _) in ranks.items() if "_0_log" in k)
    assert engine[1] == rank0  # the engine grew from rank 0's planted copy
    # The RL entrance and the engine's server came with the fork too.
    said = (run_dir / "logs" / "submitit" / next(k for k in ranks if "_0_log" in k).split(":", 1)[1]).read_text()
    assert re.search(r"forked from pid \d+ with torch, .*rlslurm\.jobs\.rl, rlslurm\.rollout\.server imported there",
                     said), said[:2000]
    # ps showed each fork as the command it stands for, under its parent.
    (supervisor,) = {parent for _, parent in ranks.values()}
    for pid, _ in ranks.values():
        assert watch.seen[pid][0] == supervisor and "-u -m submitit.core._submit" in watch.seen[pid][1][-1]
    # The engine's process showed itself as the planted copy first (unless it grew before the first look), then as
    # the server it became.
    parent, titles = watch.seen[engine[0]]
    assert parent == rank0 and "-m rlslurm.rollout.server --model" in titles[-1], titles
    assert all(f"-m rlslurm.prefork --planted-by {rank0} --run-dir {run_dir}" in t for t in titles[:-1]), titles
    first = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "first_step")
    assert first["since_process_start_s"] < 60
    time.sleep(1.0)
    assert run_processes(run_dir) == []  # ranks, engine, the planted copy, the node agent: all gone


def test_without_prefork_each_rank_and_engine_is_a_fresh_interpreter(sft, tmp_path, monkeypatch):
    monkeypatch.setenv("RLSLURM_PREFORK", "0")
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path, (f"train.init_from={sft['export']}", "train.steps=2",
                                                              "rl.eval_every=100"))
    assert len(steps(run_dir)) == 2
    assert _forks(run_dir) == {}
    assert "imported torch and transformers" not in (run_dir / "logs" / "local-supervisor.log").read_text()
    time.sleep(1.0)
    assert run_processes(run_dir) == []


@pytest.fixture(autouse=True)
def _no_prefork_env_leaks(monkeypatch):
    monkeypatch.delenv("RLSLURM_PREFORKED", raising=False)
    yield
