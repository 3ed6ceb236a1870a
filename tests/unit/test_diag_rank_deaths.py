"""How `rlslurm diag` words a trainer rank's death from the node agent's `rank_died` event (diag/summary.py):
where in its run the rank was, including a rank killed while it started, before any phase (its heartbeat then
has no phase and no step, which read as "phase None step None")."""

from __future__ import annotations

from rlslurm.diag.summary import Facts, classify

TRAIN = [{"role": "train", "rank": r, "state": "running", "pid": 100 + r, "host": "h"} for r in (0, 1)]


def _died(**fields) -> dict:
    return {"kind": "rank_died", "t": 10.0, "role": "train", "rank": 1, "rank_pid": 101, "host": "h",
            "oom_killed": False, **fields}


def _headline(event: dict) -> str:
    cause = classify(Facts(events=[event], heartbeats=TRAIN, host="h", now=100.0, pid_alive=lambda hb: True))[0]
    return f"{cause.kind}: {cause.headline}"


def test_a_rank_that_died_in_a_phase_is_named_with_its_phase_and_step():
    assert "rank_crash: trainer rank crash: train-1 (pid 101 on h) died in phase train step 4 without" in \
        _headline(_died(phase="train", step=4))


def test_a_rank_killed_before_its_first_phase_is_said_to_have_died_while_it_started():
    headline = _headline(_died(phase=None, step=None))
    assert "died while it started (before its first phase) without" in headline, headline
    assert "None" not in headline, headline
    oom = _headline(_died(phase=None, step=None, oom_killed=True, cgroup_oom_kills=1))
    assert oom.startswith("oom_kill: ") and "while it started" in oom and "None" not in oom.split("(")[1], oom


def test_a_phase_without_a_step_names_the_phase_alone():
    assert "died in phase start without" in _headline(_died(phase="start", step=None))
