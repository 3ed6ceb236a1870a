"""How `rlslurm diag` names an engine failure from its supervisor's events (diag/summary.py engine_causes):
crash or hang, past the restart budget or met by the controller, and engines replaced in a job that went on.
Real runs of both causes are replayed in test_diag_recorded.py; these are the rules between them."""

from __future__ import annotations

from rlslurm.diag.summary import Facts, classify

URL = "http://10.0.0.13:4321"
DIED = {"kind": "engine_died", "t": 10.0, "engine": 1, "node": "n3", "pid": 77, "exit_code": -9, "url": URL}
HUNG = {"kind": "engine_unhealthy", "t": 10.0, "engine": 1, "node": "n3", "pid": 77, "url": URL,
        "process_state": "stopped", "unhealthy_s": 16.1, "log": "logs/engine-1.log",
        "cause": "no healthy /health answer for 16.1 s (rollout.hang_timeout_s = 15)"}
FAILED = {"kind": "engine_failed", "t": 11.0, "url": URL, "node": "n3", "pid": 77,
          "cause": "POST /v1/completions failed: ReadError: connection reset"}


def _down(reason: str) -> dict:
    return {"kind": "engine_down", "t": 30.0, "engine": 1, "node": "n3", "restarts": 3, "max_restarts": 3,
            "reason": reason, "log": "logs/engine-1.log"}


def _first(*events: dict):
    return classify(Facts(events=list(events), host="h", now=100.0))[0]


def test_a_hung_engine_the_controller_then_met_is_a_hang_not_a_crash():
    cause = _first(HUNG, FAILED)
    assert cause.kind == "engine_hang", cause
    assert cause.headline.startswith(f"rollout engine hang: {URL} (engine 1, node n3, pid 77, process state "
                                     "stopped): no healthy /health answer for 16.1 s"), cause.headline


def test_an_engine_that_died_is_a_crash_with_its_exit_code():
    cause = _first(DIED, {**FAILED, "exit_code": -9})
    assert cause.kind == "engine_crash" and "exit code -9" in cause.headline, cause


def test_a_hang_after_the_controller_failed_does_not_rename_the_failure():
    assert _first(FAILED, {**HUNG, "t": 12.0}).kind == "engine_crash"


def test_past_the_restart_budget_the_last_verdict_names_crash_or_hang():
    failed = {**FAILED, "t": 31.0}  # the controller's: no engine left (rl/engines.py check_down)
    hang = _first(DIED, {**HUNG, "t": 20.0}, _down("hung"), failed)
    assert hang.kind == "engine_hang" and "down past rollout.max_restarts = 3" in hang.headline, hang
    assert "last: hung (on n3, pid 77, process state stopped)" in hang.headline, hang
    assert _first({**HUNG, "t": 5.0}, DIED, _down("died"), failed).kind == "engine_crash"


def test_an_engine_down_while_another_served_on_is_told_not_blamed():
    """Issue 38: engine 1 past its budget, engine 0 serving every step; the job finished. Its headline stays
    `finished`; every engine is named, the one that served throughout too."""
    serving = {"role": "rollout", "rank": 0, "state": "exited"}
    out = {"kind": "engine_out", "t": 30.5, "engine": 1, "url": URL, "resent": 0,
           "cause": "down: its supervisor gave up on it past rollout.max_restarts = 3"}
    cause = classify(Facts(events=[DIED, {**DIED, "t": 20.0}, _down("died"), out,
                                   {"kind": "done", "t": 50.0, "step": 5}],
                           heartbeats=[serving, {"role": "rollout", "rank": 1, "state": "running"}], host="h",
                           now=100.0))[0]
    assert cause.kind == "finished", cause
    assert "engine 0: served throughout (no death, no hang, never out of rotation)" in cause.evidence, cause
    assert ("engine 1: 2 deaths, down past rollout.max_restarts = 3 on n3: out of rotation for good, the others "
            "served on") in cause.evidence, cause


def test_engines_replaced_in_a_job_that_finished_are_evidence_of_it():
    cause = _first(DIED, {**HUNG, "t": 20.0}, {"kind": "done", "t": 50.0, "step": 5})
    assert cause.kind == "finished", cause
    assert any(line.startswith("engine 1 died (on n3, pid 77, exit code -9); replaced") for line in cause.evidence)
    assert any(line.startswith("engine 1 hung (on n3, pid 77, process state stopped)") for line in cause.evidence)
