"""The cause classifier on recorded real runs: tests/data/diag/<cause>/ holds what `rlslurm diag` collected
from a real run of that failure (events, heartbeats, env fingerprints, log tails; tests/data/diag/record.py
made them, tests/integration/failures.py says how each failure was made). Each is replayed through the
classifier as the bundle feeds it, and must be named as the cause it was made for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.diag.env_diff import compare, read_fingerprints
from rlslurm.diag.summary import Facts, classify, render
from rlslurm.rundir import read_jsonl

DATA = Path(__file__).resolve().parents[1] / "data" / "diag"
CAUSES = {
    # cause -> words its headline must hold (what makes the line useful to a person)
    "finished": "finished OK",
    "exception": "Python exception in train-0 during phase train step 3: RuntimeError: toy fault",
    "hang": "hang in collective all_reduce on ranks train-0, waiting on train-1",
    "desync": "collective desync: train-1 skipped all_reduce #",
    "running": "still running (step",
    "unknown": "no cause found",
    "oom": "can't allocate memory",
    "env_mismatch": "torch differs between train and rollout",
    "reward_down": "reward service down: gone past its restart budget",
    "sync_failure": "weight-sync VERIFY failed",
    "engine_crash": "rollout engine crash",
    "engine_hang": "rollout engine hang",
    "time_limit": "time limit reached",
    "preempted": "preempted by SLURM",
    "node_failure": "node failure",
    "heartbeat_unwritable": "heartbeat cannot be written: train-0",
    "agent_died": "node agent died: pid",
    "rank_crash": "trainer rank crash: train-1 (pid",
    "oom_kill": "out of memory: the kernel's OOM killer killed train-1 (pid",
    "disk_full": "no space left on device while checkpointing step 6 (train-0: 0 bytes free on",
    "checkpoint_damaged": "damaged checkpoint skipped: step-00000006 (sha256 mismatch in model.safetensors)",
}
"""Every cause the classifier names (summary.Cause.kind)."""


def recorded_facts(folder: Path) -> Facts:
    """The Facts diag/bundle.py's `collect` builds, from a recorded bundle; what no file holds (the time,
    the host, which processes were alive, SLURM's state) from recorded.json."""
    meta = json.loads((folder / "recorded.json").read_text())
    fps = read_fingerprints(folder / "env") if (folder / "env").is_dir() else {}
    # As the bundle does: the sync method the plan decided (layout.json), else as strictly as broadcast.
    layout = folder / "run" / "layout.json"
    diff = compare(fps, sync_method=json.loads(layout.read_text())["sync_method"] if layout.is_file()
                   else "broadcast") if fps else None
    alive = set(meta["alive"])
    logs = {str(p.relative_to(folder / "logs"))[: -len(".tail")]: p.read_text()
            for p in sorted((folder / "logs").rglob("*.tail"))}
    return Facts(events=read_jsonl(folder / "run" / "events.jsonl"),
                 heartbeats=[json.loads(p.read_text()) for p in sorted((folder / "heartbeats").glob("*.json"))],
                 logs=logs, slurm_state=meta["slurm_state"],
                 env_errors=[f.message for f in diff.errors] if diff else [],
                 now=meta["recorded_at"], host=meta["host"], pid_alive=lambda hb: hb["file"] in alive)


RECORDED = sorted(p.name for p in DATA.iterdir() if (p / "recorded.json").is_file())


@pytest.mark.parametrize("cause", RECORDED)
def test_a_recorded_run_is_named_as_the_cause_it_was_made_for(cause):
    folder = DATA / cause
    meta = json.loads((folder / "recorded.json").read_text())
    causes = classify(recorded_facts(folder))
    assert meta["cause"] == cause and causes[0].kind == cause, render(causes)
    assert CAUSES[cause] in causes[0].headline, causes[0].headline


def test_every_cause_has_a_recorded_run():
    assert set(RECORDED) == set(CAUSES), f"not recorded: {sorted(set(CAUSES) - set(RECORDED))}"


def test_an_oom_past_a_forced_preflight_says_so():
    (cause, *_) = classify(recorded_facts(DATA / "oom"))
    assert cause.evidence[0].startswith("submitted with --force past the plan's pre-flight: "), cause.evidence


# -- one rule for a finished job (issue 28, case 5): its headline is "finished", what it survived is evidence --

@pytest.mark.parametrize("cause", ["heartbeat_unwritable", "agent_died", "checkpoint_damaged"])
def test_a_completed_job_is_finished_with_what_it_survived_as_evidence(cause):
    """These recordings were made while the job still ran; SLURM's COMPLETED (what `diag` reads from sacct
    once the job ended) must make the headline "finished", the fault evidence under it. Before, a recording
    whose heartbeats still looked alive headlined the fault ("heartbeat cannot be written")."""
    facts = recorded_facts(DATA / cause)
    during = classify(facts)[0]
    facts.slurm_state = "COMPLETED"
    (cause_,) = classify(facts)
    assert cause_.kind == "finished" and cause_.headline.startswith("finished OK"), render([cause_])
    assert f"survived {cause}: {during.headline}" in cause_.evidence, cause_.evidence


def test_a_completed_job_whose_processes_still_beat_is_finished_naming_them():
    """A process that outlived its finished job (the issue's orphaned reward service) is evidence, not
    "still running": the job itself is over."""
    facts = recorded_facts(DATA / "running")
    facts.slurm_state = "COMPLETED"
    (cause,) = classify(facts)
    assert cause.kind == "finished", render([cause])
    assert sum("still runs after the job finished" in line for line in cause.evidence) == 2, cause.evidence


def test_a_finished_job_without_faults_lists_none():
    (cause,) = classify(recorded_facts(DATA / "finished"))
    assert cause.headline == "finished OK (2 processes exited cleanly)" and cause.evidence == []


def test_a_node_failure_names_the_node():
    (cause, *_) = classify(recorded_facts(DATA / "node_failure"))
    assert cause.headline.startswith("node failure: n1 lost"), cause.headline
