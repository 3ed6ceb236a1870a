"""Hold one trainer rank at interpreter exit, after its entrance returned, without touching the job's code:
a sitecustomize on PYTHONPATH that registers an atexit handler which sleeps (a teardown that never returns).

    plant_exit_hold(tmp_path, monkeypatch, rank_var="SUBMITIT_LOCAL_GLOBALID")   # off SLURM; SLURM_PROCID on it
    ... run the job ...; held.read_text() is the held rank's pid once it reached its exit
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SITE = '''
import atexit, os, sys, time

def _hold():
    if sys.argv and sys.argv[0].endswith(os.path.join("submitit", "core", "_submit.py")):
        open(os.environ["RLSLURM_TEST_HELD"], "w").write(str(os.getpid()))
        time.sleep(3600)  # stands in for a teardown that never returns

if os.environ.get({rank_var!r}) == "1":
    atexit.register(_hold)
'''


def plant_exit_hold(tmp_path: Path, monkeypatch, rank_var: str) -> Path:
    """Make rank 1 (by `rank_var`) of jobs started from this test hang at exit; returns the file that gets
    its pid when it does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE.format(rank_var=rank_var))
    held = tmp_path / "held.pid"
    monkeypatch.setenv("PYTHONPATH", f"{site}:{ROOT}")
    monkeypatch.setenv("RLSLURM_TEST_HELD", str(held))
    return held
