"""The SLURM spine end to end on the real local cluster: `rlslurm submit` of the toy job (jobs/toytrain.py,
2 DDP ranks over gloo on a `train` node + the stand-in component on a `rollout` node), then every way a
job is stopped and comes back: the pre-timeout USR1, `scontrol requeue`, preemption by the `urgent`
partition, a real time limit, SIGKILL while a checkpoint is half written, and `scancel` followed by
`rlslurm resume <jobid>`. Each run must end with the
uninterrupted reference's weights checksum and per-step losses. Prints MEASURE lines (-s shows them).

    python -m pytest -q -s tests/cluster/test_spine.py

The time-limit job needs about two minutes of allocations, so it is submitted first (an autouse fixture)
and runs on the second train node while the other tests run; its test, last in the file, waits for it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import spine_util as su
from rlslurm import launch
from rlslurm.checkpoint import latest_complete, step_dirname
from rlslurm.cli.main import cli
from rlslurm.lifecycle import SLURM_SIGTERM
from rlslurm.rundir import RunDir, find_run, read_jsonl
from rlslurm.slurm import commands, parse
from rlslurm.status import follow
from spine_util import INTERVAL, STEPS

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 150
"""Bound on one toy job, requeues included (~10-30 s each on an idle machine; the 2 cores are shared)."""


@pytest.fixture(scope="module", autouse=True)
def timelimit_job(_cancel_and_tidy_at_end, slurm_cluster, tmp_path_factory):
    """A job with more training (24 steps x 2.6 s) than one 1-minute allocation holds. USR1 comes
    signal_before_s = 10 before the limit (SLURM sends it up to ~30 s earlier still: ~20-27 s into each
    allocation, measured), the kill up to 30 s after it: each allocation drains, checkpoints and requeues."""
    root = tmp_path_factory.mktemp("timelimit")
    config = su.toy_config(root / "timelimit.yaml", root / "runs", step_delay_s=2.6, time_limit_min=1,
                           signal_before_s=10)
    return su.submit(config)


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Path:
    """The uninterrupted run, submitted with the CLI like a user would; its run directory."""
    root = tmp_path_factory.mktemp("reference")
    config = su.toy_config(root / "reference.yaml", root / "runs", step_delay_s=0.05)
    result = CliRunner().invoke(cli, ["submit", str(config)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    job_id = re.search(r"submitted slurm job (\d+)", result.output).group(1)
    run = Path(re.search(r"run directory: (.+)", result.output).group(1))
    su.TRACKED.append((job_id, run))
    # `rlslurm status --follow` (as a library call, to kick the local cluster's idle scheduler as it waits)
    lines = []
    ended = follow(job_id, root / "runs", lines.append, poll_s=0.5, timeout_s=JOB_TIMEOUT_S,
                   sleep=lambda s: (slurm_cluster.kick(), time.sleep(s)))
    assert ended == "COMPLETED" and [x for x in lines if x][-1].startswith(f"step {STEPS}/{STEPS} 100% | loss ")
    su.wait_done(job_id, run, JOB_TIMEOUT_S, slurm_cluster.kick)
    assert sorted(su.losses(run)) == list(range(1, STEPS + 1))
    return run


def test_het_job_lands_on_train_and_rollout_and_status_shows_it(slurm_cluster, reference):
    submitted = read_jsonl(reference / "submissions.jsonl")
    job_id = submitted[0]["job_id"]
    # placement.jsonl: one line per task and start, written by each process where it landed.
    by_role = {(p["role"], p["rank"]): p for p in su.placements(reference)}
    assert sorted(by_role) == [("rollout", 0), ("train", 0), ("train", 1)]
    assert by_role["train", 0]["partition"] == by_role["train", 1]["partition"] == "train"
    assert by_role["rollout", 0]["partition"] == "rollout"
    assert by_role["train", 0]["node"] in {"n1", "n2"} and by_role["rollout", 0]["node"] in {"n3", "n4"}
    assert {p["job_id"] for p in by_role.values()} == {job_id}
    (started,) = su.events(reference, "component_started")
    assert (started["component_role"], started["partition"], started["nodes"]) == (
        "rollout", "rollout", [by_role["rollout", 0]["node"]])
    assert sorted(p.name for p in (reference / "env").iterdir()) == ["rollout-0.json", "train-0.json", "train-1.json"]

    result = CliRunner().invoke(cli, ["status", job_id, "--run-root", str(reference.parent)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"job: {job_id} (slurm), restarts: 0" in out
    assert f"component 0: COMPLETED partition=train nodes={by_role['train', 0]['node']}" in out
    assert f"component 1: COMPLETED partition=rollout nodes={by_role['rollout', 0]['node']}" in out
    assert f"last complete checkpoint: {step_dirname(STEPS)}" in out
    assert f"progress: step {STEPS}/{STEPS} 100% | loss " in out and out.count("| done\n") == 1
    assert " done train-0 " in out


def test_every_spelling_of_the_het_job_finds_its_run(slurm_cluster, reference):
    """One run lookup (rundir.find_run) on a real het job: the leader's id, `leader+1` as squeue prints
    component 1, component 1's own SLURM id (its task recorded it in placement.jsonl) and the directory
    all name the run, and every answer carries the leader's id."""
    job_id = read_jsonl(reference / "submissions.jsonl")[0]["job_id"]
    (rollout,) = [p for p in su.placements(reference) if p["role"] == "rollout"]
    own = {r["HetJobOffset"]: r["JobId"] for r in commands.show_job(job_id)}["1"]
    assert rollout["slurm_job_id"] == own != job_id, rollout
    for target in (job_id, f"{job_id}+1", own, str(reference)):
        assert find_run(target, reference.parent) == (RunDir(reference), job_id), target
    result = CliRunner().invoke(cli, ["status", own, "--run-root", str(reference.parent)], catch_exceptions=False)
    assert result.exit_code == 0 and f"job: {job_id} (slurm)" in result.output, result.output


def test_usr1_drains_all_ranks_at_one_step_requeues_and_resumes_exactly(slurm_cluster, reference, tmp_path):
    sub = su.submit(su.toy_config(tmp_path / "usr1.yaml", tmp_path / "runs"))
    su.wait_for("step 6", lambda: su.last_step(sub.run_dir) >= 6, JOB_TIMEOUT_S)
    # To the steps (no -b/-f): every rank and the rollout stand-in get it, as with --signal=USR1@N.
    commands.scancel(sub.job_id, signal="USR1")
    # What `rlslurm submit --wait` waits with: it follows the job through its requeue (the first
    # allocation's result, exit 75, is not the job's) and returns the last allocation's exit codes.
    assert launch.wait(sub, timeout_s=JOB_TIMEOUT_S, poll_s=1.0, on_poll=slurm_cluster.kick) == [0, 0]
    su.wait_done(sub.job_id, sub.run_dir, JOB_TIMEOUT_S, slurm_cluster.kick)
    run = sub.run_dir

    requested = su.events(run, "drain_requested")
    # slurmstepd signals the tasks one by one: a rank whose USR1 lands after the ranks agreed on the drain
    # step (the all-reduce of the flags) drains by its peer's flag and records no request.
    assert requested and {e["signal"] for e in requested} == {"SIGUSR1"} and {e["rank"] for e in requested} <= {0, 1}
    (drained,) = su.events(run, "drained")
    step = drained["step"]
    assert 6 <= step < STEPS and drained["checkpoint"] == step_dirname(step) and drained["requeued"] is True
    (requeue,) = su.events(run, "requeue")
    assert requeue["job_id"] == sub.job_id and requeue["step"] == step
    # Both ranks stopped at the drain step: no loss of the first start past it.
    first_start = [m for m in read_jsonl(RunDir(run).metrics) if m.get("restart_count") == 0 and "loss" in m]
    assert max(m["step"] for m in first_start) == step
    (resume,) = su.events(run, "resume")
    assert (resume["step"], resume["checkpoint"], resume["restart_count"]) == (step, step_dirname(step), 1)
    assert {p["restart_count"] for p in su.placements(run, "train")} == {0, 1}
    assert commands.show_job(sub.job_id)[0]["Restarts"] == "1"
    assert su.losses(run) == su.losses(reference)
    assert su.final_sha(run) == su.final_sha(reference)
    # The stand-in ignores USR1 (it has nothing to drain): rank 0 stops it; srun reports a death by USR1
    # in rank 0's log (submitit's *_0_log.err) otherwise.
    logs = "".join(p.read_text(errors="replace") for p in (run / "logs").rglob("*log*") if p.is_file())
    assert "User defined signal 1" not in logs
    print("\n" + su.measure_line("USR1 self-requeue", su.restart_timing(run, requeue["t"], 1)))


def _requeued_and_finished(slurm_cluster, reference, sub, requeued_at: float, step_at_requeue: int, name: str):
    su.wait_done(sub.job_id, sub.run_dir, JOB_TIMEOUT_S, slurm_cluster.kick)
    run = sub.run_dir
    (resume,) = su.events(run, "resume")
    assert resume["restart_count"] == 1
    # Work since the last periodic checkpoint may be lost, never more than one interval.
    assert resume["step"] >= step_at_requeue - INTERVAL, (resume, step_at_requeue)
    assert su.losses(run) == su.losses(reference)
    assert su.final_sha(run) == su.final_sha(reference)
    print("\n" + su.measure_line(name, su.restart_timing(run, requeued_at, 1))
          + f" [step at requeue {step_at_requeue}, resumed at {resume['step']}]")
    return resume


def test_scontrol_requeue_resumes_from_last_checkpoint(slurm_cluster, reference, tmp_path):
    sub = su.submit(su.toy_config(tmp_path / "requeue.yaml", tmp_path / "runs"))
    su.wait_for("step 9", lambda: su.last_step(sub.run_dir) >= 9, JOB_TIMEOUT_S)
    step_at_requeue, requeued_at = su.last_step(sub.run_dir), time.time()
    commands.requeue(sub.job_id)
    _requeued_and_finished(slurm_cluster, reference, sub, requeued_at, step_at_requeue, "scontrol requeue")
    (drained,) = su.events(sub.run_dir, "drained")
    assert drained["signal"] == "SIGTERM" and drained["requeued"] == SLURM_SIGTERM


def test_preemption_by_urgent_partition_resumes_from_last_checkpoint(slurm_cluster, reference, tmp_path):
    sub = su.submit(su.toy_config(tmp_path / "preempt.yaml", tmp_path / "runs"))
    su.wait_for("step 9", lambda: su.last_step(sub.run_dir) >= 9, JOB_TIMEOUT_S)
    node = su.train_node(sub)
    step_at_requeue, requeued_at = su.last_step(sub.run_dir), time.time()
    # One task on exactly the train node: it fits only if the toy job (both CPUs of that node) goes.
    urgent = commands.sbatch(["--partition=urgent", f"--nodelist={node}", "--ntasks=1", "--time=1",
                              "--job-name=urgent", f"--output={tmp_path / 'urgent-%j.out'}", "--wrap=sleep 2"])
    resume = _requeued_and_finished(slurm_cluster, reference, sub, requeued_at, step_at_requeue, "preemption")
    urgent_rec = commands.show_job(urgent)[0]
    assert urgent_rec["JobState"] == "COMPLETED" and urgent_rec["NodeList"] == node
    # The toy job came back only after the urgent job had its node.
    restarted = min(p["t"] for p in su.placements(sub.run_dir, "train", 1))
    assert restarted > su.events(sub.run_dir, "drained")[0]["t"] and resume["t"] > restarted


def test_sigkill_while_writing_checkpoint_resumes_from_previous_complete(slurm_cluster, reference, tmp_path,
                                                                         monkeypatch):
    interval = 2 * INTERVAL
    # sbatch exports the submitter's environment: the job's ranks get the checkpoint pause hook (3 s after
    # the first file of every save from step 16), the window in which the test kills the writer.
    monkeypatch.setenv("RLSLURM_TEST_PAUSE_IN_CHECKPOINT_S", f"3@{2 * interval}")
    # No trainer restart inside the allocation (train.max_restarts 0): the trainer supervisor requeues the job
    # at once, and asks SLURM to keep it off the node whose rank died (of the 2 train nodes here, the other).
    sub = su.submit(su.toy_config(tmp_path / "sigkill.yaml", tmp_path / "runs", interval_steps=interval,
                                  max_restarts=0))
    monkeypatch.delenv("RLSLURM_TEST_PAUSE_IN_CHECKPOINT_S")
    run = RunDir(sub.run_dir)
    _, _, killed_at = su.kill_checkpoint_writer_and_requeue(sub, 2 * interval, JOB_TIMEOUT_S, slurm_cluster.kick,
                                                            requeue=False)
    (node,) = {p["node"] for p in su.placements(sub.run_dir, "train", 0)}
    (spent,) = su.events(sub.run_dir, "trainer_restarts_spent")
    assert spent["node"] == node and spent["excluded"] == [node] and "scontrol requeue" in spent["requeue"], spent
    assert node in parse.expand_nodelist(commands.show_job(sub.job_id)[0]["ExcNodeList"])
    assert {p["node"] for p in su.placements(sub.run_dir, "train", 1)}.isdisjoint({node})
    status = CliRunner().invoke(cli, ["status", str(sub.run_dir)]).output
    assert f"kept off node {node}: " in status and "SLURM excluded it" in status, status
    (resume,) = su.events(sub.run_dir, "resume")
    assert (resume["step"], resume["checkpoint"]) == (interval, step_dirname(interval))
    assert latest_complete(run, tidy=False).step == STEPS
    assert su.losses(sub.run_dir) == su.losses(reference)
    assert su.final_sha(sub.run_dir) == su.final_sha(reference)
    print("\n" + su.measure_line("SIGKILL mid-checkpoint + requeue", su.restart_timing(sub.run_dir, killed_at, 1)))


def test_a_cancelled_job_is_resumed_by_job_id_and_finishes_as_the_reference(slurm_cluster, reference, tmp_path):
    """scancel stops the job for good (SLURM does not requeue it); `rlslurm resume <jobid>` submits the run
    again, a new job in the same run directory, which goes on from the checkpoint the cancel left."""
    sub = su.submit(su.toy_config(tmp_path / "cancel.yaml", tmp_path / "runs"))
    su.wait_for("step 9", lambda: su.last_step(sub.run_dir) >= 9, JOB_TIMEOUT_S)
    runner = CliRunner()
    refused = runner.invoke(cli, ["resume", sub.job_id, "--run-root", str(tmp_path / "runs")])
    assert refused.exit_code == 1 and "is not stopped" in refused.output, refused.output
    commands.scancel(sub.job_id)
    su.wait_for(f"job {sub.job_id} cancelled", lambda: su.state(sub.job_id) == "CANCELLED", 60, poll_s=0.25)
    su.wait_for("every rank's exit", lambda: not launch.signs_of_life(RunDir(sub.run_dir), su.load_config(
        sub.run_dir / "config.yaml"), time.time()), 30, poll_s=0.25)
    step_at_cancel = su.last_step(sub.run_dir)

    result = runner.invoke(cli, ["resume", sub.job_id, "--run-root", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    job_id = re.search(r"submitted slurm job (\d+)", result.output).group(1)
    assert job_id != sub.job_id and f"run directory: {sub.run_dir}" in result.output
    su.TRACKED.append((job_id, sub.run_dir))
    su.wait_done(job_id, sub.run_dir, JOB_TIMEOUT_S, slurm_cluster.kick)
    (resume,) = su.events(sub.run_dir, "resume")
    assert step_at_cancel - INTERVAL <= resume["step"] <= step_at_cancel  # the cancel's drain or a periodic one
    assert str(read_jsonl(RunDir(sub.run_dir).jobs)[-1]["job_id"]) == job_id
    assert su.losses(sub.run_dir) == su.losses(reference)
    assert su.final_sha(sub.run_dir) == su.final_sha(reference)


def test_local_backend_finishes_with_the_same_checksum(reference, tmp_path, monkeypatch):
    sub = su.submit(su.toy_config(tmp_path / "local.yaml", tmp_path / "runs", step_delay_s=0.0, backend="local"))
    assert sub.backend == "local"
    assert launch.wait(sub, timeout_s=JOB_TIMEOUT_S, poll_s=0.5) == [0, 0]
    assert "MASTER_PORT" not in os.environ  # submit put the local tasks' environment back
    assert {p["partition"] for p in su.placements(sub.run_dir)} == {None}
    assert su.losses(sub.run_dir) == su.losses(reference)
    assert su.final_sha(sub.run_dir) == su.final_sha(reference)


def test_time_limit_drains_before_the_kill_and_resumes_until_done(slurm_cluster, reference, timelimit_job):
    sub = timelimit_job
    su.wait_done(sub.job_id, sub.run_dir, 240, slurm_cluster.kick)
    run = sub.run_dir
    drained = su.events(run, "drained")
    resumes = su.events(run, "resume")
    restarts = int(commands.show_job(sub.job_id)[0]["Restarts"])
    assert len(drained) >= 1 and len(resumes) == len(drained) == restarts
    for k, (d, r) in enumerate(zip(drained, resumes), start=1):
        # The pre-timeout USR1 (no SIGTERM: the kill never came) drained, checkpointed and requeued.
        assert (d["signal"], d["requeued"], d["checkpoint"]) == ("SIGUSR1", True, step_dirname(d["step"]))
        assert (r["step"], r["checkpoint"], r["restart_count"]) == (d["step"], d["checkpoint"], k)
        started = min(p["t"] for p in su.placements(run, "train", k - 1))
        assert d["t"] - started < 60, f"allocation {k - 1} drained {d['t'] - started:.0f} s after its start"
    assert not su.events(run, "drain_checkpoint_skipped")
    assert su.state(sub.job_id) == "COMPLETED"
    assert su.losses(run) == su.losses(reference)
    assert su.final_sha(run) == su.final_sha(reference)
    timing = su.restart_timing(run, drained[0]["t"], 1)
    print("\n" + su.measure_line("time-limit USR1", timing)
          + f" [{restarts + 1} allocations, drained at steps {[d['step'] for d in drained]}]")


def test_usr1_before_the_drain_gate_becomes_a_drain_request(tmp_path):
    """A pre-timeout USR1 that lands while a rank still imports torch must not kill it (its default
    action): jobs/entry.py keeps it as control/drain, which the drain gate reads at the first step."""
    from rlslurm.diag.drain_gate import DRAIN_FILE, DrainGate
    from rlslurm.jobs.entry import _keep_early_drain_signal

    run = RunDir(tmp_path / "run").create()
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        _keep_early_drain_signal(run)
        os.kill(os.getpid(), signal.SIGUSR1)
        su.wait_for("the handler to run", (run.control / DRAIN_FILE).exists, 5, poll_s=0.01)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    gate = DrainGate(run)
    assert gate.check() and gate.reason == f"control file {run.control / DRAIN_FILE}"
