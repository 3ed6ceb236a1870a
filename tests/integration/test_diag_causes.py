"""`rlslurm diag` names the cause of a real run that failed for it: the reward service gone past its restart
budget, a weight sync whose VERIFY failed, an engine that died, a trainer rank killed (its peer's error is the
symptom), a full disk while checkpointing, a damaged newest checkpoint skipped at resume (and said by `rlslurm
resume` itself). Each run is made by tests/integration/failures.py (local backend: real trainer ranks, engine
server, reward service), then the CLI runs on its run directory, as a user would.

    python -m pytest -q tests/integration/test_diag_causes.py      # ~1 min per run on 2 idle cores
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

import failures
from rlslurm import events
from rlslurm.cli.main import cli
from rlslurm.rundir import RunDir

pytestmark = pytest.mark.slow


def diag(run, tmp_path) -> str:
    """`rlslurm diag RUN --out TMP --no-slurm`: what it prints."""
    result = CliRunner().invoke(cli, ["diag", str(run), "--out", str(tmp_path / "bundles"), "--no-slurm"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_reward_service_past_its_restart_budget(tmp_path):
    made = failures.reward_down(tmp_path)
    (down,) = events.read_events(RunDir(made.run), events.REWARD_SERVICE_DOWN)
    assert (down["restarts"], down["attempts"], down["max_restarts"]) == (1, 1, 1)
    assert down["log"].endswith("logs/reward-service.log") and down["reason"] == "died"
    out = diag(made.run, tmp_path)
    line = re.search(r"^cause: (.*)$", out, re.MULTILINE).group(1)
    assert line.startswith("reward service down: gone past its restart budget (1 restarts, 1 tried, "
                           "reward.max_restarts = 1; last: died)"), out
    assert f"service log: {down['log']}" in out
    # The symptom, listed after the cause: in turn the trainer's reward phase failed; with the rollout ahead of it
    # (rl.max_staleness 1, the demo's) the producer's reward failed, and the trainer met it where it next waited on
    # the producer (for the step's experience, or before a sync for the rollouts on the old weights).
    assert re.search(r"^also seen: Python exception in train-0 during phase (reward|wait_experience|sync) step \d+: "
                     r"RewardServiceError", out, re.MULTILINE), out


def test_weight_sync_verify_failure(tmp_path):
    made = failures.sync_failure(tmp_path)
    (failed,) = events.read_events(RunDir(made.run), events.SYNC_VERIFY_FAILED)
    assert failed["attempts"] == 2 and failed["step"] == 0 and failed["version"] == 0
    assert [m["name"] for m in failed["mismatches"]] == [failures.CORRUPTED]
    assert [e["attempt"] for e in events.read_events(RunDir(made.run), events.SYNC_VERIFY_MISMATCH)] == [1, 2]
    out = diag(made.run, tmp_path)
    assert re.search(rf"^cause: weight-sync VERIFY failed at step 0: the sync to version 0 via broadcast left 1 "
                     rf"tensors differing on {re.escape(failed['engine'])} after 2 attempts \(first "
                     rf"'{re.escape(failures.CORRUPTED)}': expected float32\[256,64\]:\w+:\w+:\w+, engine has "
                     rf"float32\[256,64\]:\w+:\w+:\w+\)$", out, re.MULTILINE), out


def test_engine_killed_mid_run(tmp_path):
    made = failures.engine_crash(tmp_path)
    (failed,) = events.read_events(RunDir(made.run), events.ENGINE_FAILED)
    assert failed["exit_code"] == -9 and failed["log"].endswith("engine-0.log") and failed["node"]
    out = diag(made.run, tmp_path)
    # rollout.max_restarts 0: the lone engine is down for good (with restarts it is replaced and the run goes on)
    assert re.search(rf"^cause: rollout engine crash: engine 0 on \S+ down past rollout.max_restarts = 0 \(0 "
                     rf"replacements\); last: died \(on \S+, pid {failed['pid']}, exit code -9\)", out,
                     re.MULTILINE), out
    # the symptom, listed after the cause, in whichever form reached the trainer first: its request cut off by
    # the kill, its next request told by the supervisor that the engine is down for good, or (the rollout running
    # ahead of the trainer, the demo's rl.max_staleness 1) the weight sync's drain of the dead engine refused
    assert re.search(r"^also seen: (.*; )?Python exception in train-\d during phase \w+ step \d+: "
                     r"(EngineRequestError|SyncStageError): .*((POST|GET) /\S+ failed: (ConnectError|ReadError|"
                     r"RemoteProtocolError)|down: its supervisor gave up on it past rollout.max_restarts = 0)", out,
                     re.MULTILINE), out


def test_engine_stopped_mid_run(tmp_path):
    made = failures.engine_hang(tmp_path)
    (hung,) = events.read_events(RunDir(made.run), events.ENGINE_UNHEALTHY)
    assert hung["engine"] == 0 and hung["process_state"] == "stopped" and hung["node"] and hung["pid"]
    out = diag(made.run, tmp_path)
    assert re.search(rf"^cause: rollout engine hang: engine 0 on {hung['node']} down past rollout.max_restarts = 0 "
                     rf"\(0 replacements\); last: hung \(on \S+, pid {hung['pid']}, process state stopped\): no "
                     rf"healthy /health answer for \S+ s \(rollout.hang_timeout_s = 3\)", out, re.MULTILINE), out


def test_trainer_rank_killed_is_named_not_its_peer(tmp_path):
    made = failures.rank_crash(tmp_path)
    out = diag(made.run, tmp_path)
    assert re.search(r"^cause: trainer rank crash: train-1 \(pid \d+ on \S+\) died in phase \w+ step \d+ without a "
                     r"Python exception", out, re.MULTILINE), out
    assert "train-0 then ended failed" in out


def test_disk_full_while_checkpointing(tmp_path):
    made = failures.disk_full(tmp_path)
    try:
        (failed,) = events.read_events(RunDir(made.run), events.CHECKPOINT_FAILED)
        assert (failed["step"], failed["errno"], failed["disk_full"], failed["newest_complete"]) == \
            (6, "ENOSPC", True, "step-00000003")
        assert not list((made.run / "checkpoints").glob(".tmp-*")), "the failed save left its temp dir"
        out = diag(made.run, tmp_path)
    finally:
        made.close()
    assert re.search(r"^cause: no space left on device while checkpointing step 6 \(train-0: 0 bytes free on \S+\); "
                     r"the newest complete checkpoint step-00000003 is intact", out, re.MULTILINE), out


def test_a_damaged_newest_checkpoint_is_skipped_and_said(tmp_path):
    made = failures.checkpoint_damaged(tmp_path)  # asserts what `rlslurm resume` printed
    try:
        out = diag(made.run, tmp_path)
    finally:
        made.close()
    assert re.search(r"^cause: damaged checkpoint skipped: step-00000006 \(sha256 mismatch in model.safetensors\), "
                     r"kept aside as step-00000006.corrupt-\d+; resumed from step-00000003 \(step 3\)$", out,
                     re.MULTILINE), out


def test_a_rank_killed_by_the_oom_killer_is_named_so(tmp_path):
    made = failures.oom_kill(tmp_path)
    try:
        (died,) = events.read_events(RunDir(made.run), events.RANK_DIED)
        out = diag(made.run, tmp_path)
    finally:
        made.close()
    assert died["rank"] == 1 and died["oom_killed"] is True and died["cgroup_oom_kills"] == 1, died
    # Its phase and step as its last heartbeat write had them (the flusher lags a few steps under load).
    assert died["memory_limit_bytes"] == 256 << 20 and 2 <= died["step"] <= 12, died
    assert re.search(rf"^cause: out of memory: the kernel's OOM killer killed train-1 \(pid {died['rank_pid']} on "
                     rf"\S+\) in phase {died['phase']} step {died['step']} \(memory cgroup \S+rlslurm-test-oom-\d+: "
                     rf"oom_kill \+1, limit 256 MiB, peak \d+ MiB\)$", out, re.MULTILINE), out
    assert "train-0 then ended failed" in out  # the peer's gloo error: the symptom, after the cause
