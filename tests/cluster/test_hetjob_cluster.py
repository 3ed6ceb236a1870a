"""Het jobs on the real local Slurm cluster: placement per partition, requeue-and-restart, USR1 to the
batch shell, and job state through commands.py + parse.py. Prints MEASURE lines (run with -s to see them).

    python -m pytest -q -s tests/cluster/test_hetjob_cluster.py
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

from rlslurm.slurm import commands, hetjob
from rlslurm.slurm.hetjob import Component, HetSlurmExecutor, render_template
from waiting import wait_for

pytestmark = pytest.mark.cluster

# The job's python cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def record_components(out_dir: str) -> hetjob.HetContext:
    """Job function: every task notes its node; rank 0 starts components 1 and 2, then waits for `go`."""
    ctx = hetjob.context()
    Path(out_dir, f"g0-r{ctx.rank}").write_text(f"{os.environ['SLURMD_NODENAME']} {ctx.world}")
    if ctx.rank == 0:
        note = 'echo "$SLURMD_NODENAME $SLURM_NTASKS" > "$OUT/g$RLSLURM_HET_GROUP-r$SLURM_PROCID"'
        steps = [hetjob.launch_component(g, ["bash", "-c", note], env={"OUT": out_dir}) for g in (1, 2)]
        if any(s.wait(timeout_s=60) != 0 for s in steps):
            raise RuntimeError("a component step failed")
        go = Path(out_dir, "go")
        for _ in range(600):  # the test inspects the running job, then says go; bounded at 60 s
            if go.exists():
                break
            threading.Event().wait(0.1)
    return ctx


def test_het_components_land_on_their_partitions(slurm_cluster, tmp_path):
    out = tmp_path / "out dir"
    out.mkdir()
    ex = HetSlurmExecutor(tmp_path / "sub mit", components=[Component(partition="rollout", ntasks_per_node=2),
                                                             Component(partition="cpu")])
    ex.update_parameters(partition="train", nodes=2, ntasks_per_node=1, time=5, job_name="placement",
                         additional_parameters={"requeue": True})
    t0 = time.monotonic()
    job = ex.submit(record_components, str(out))
    submitted = time.monotonic()
    wait_for("component 0 to start", lambda: (out / "g0-r0").exists(), 60)
    first_s = time.monotonic() - submitted
    wait_for("components 1 and 2", lambda: len(list(out.glob("g[12]-r*"))) == 3, 60)

    records = commands.show_job(job.job_id)
    assert [(r["HetJobId"], r["HetJobOffset"], r["Partition"], r["JobState"]) for r in records] == [
        (job.job_id, "0", "train", "RUNNING"), (job.job_id, "1", "rollout", "RUNNING"),
        (job.job_id, "2", "cpu", "RUNNING")]
    rows = commands.squeue([job.job_id])
    assert sorted(r["HetJobOffset"] for r in rows) == ["0", "1", "2"]
    assert all(r["HetJobID"] == job.job_id for r in rows)
    assert hetjob.job_states([job.job_id])[job.job_id]["State"] == "RUNNING"
    (out / "go").touch()

    ctx = job.results()[0]
    total_s = time.monotonic() - t0
    nodes = {p.name: p.read_text().split() for p in out.glob("g*-r*")}
    assert {nodes["g0-r0"][0], nodes["g0-r1"][0]} == {"n1", "n2"} and nodes["g0-r0"][1] == "2"
    assert nodes["g1-r0"] == nodes["g1-r1"] and nodes["g1-r0"][0] in {"n3", "n4"} and nodes["g1-r0"][1] == "2"
    assert nodes["g2-r0"] == ["n5", "1"]
    assert [c.partition for c in ctx.components] == ["train", "rollout", "cpu"]
    assert ctx.components[1].nodes == (nodes["g1-r0"][0],) and ctx.leader_job_id == job.job_id

    wait_for("COMPLETED in squeue", lambda: hetjob.job_states([job.job_id]).get(job.job_id, {}).get("State")
             == "COMPLETED", 30)
    comp = wait_for_jobcomp(job.job_id)
    assert comp["State"] == "COMPLETED" and comp["Partition"] == "train"
    print(f"\nMEASURE cluster_up_s={slurm_cluster.up_s:.2f} first_job_start_s={first_s:.2f} "
          f"three_component_job_total_s={total_s:.2f}")


def wait_for_jobcomp(job_id: str) -> dict:
    rows: list[dict] = []

    def found():
        rows[:] = [r for r in commands.sacct([job_id]) if r["JobID"] == job_id]
        return bool(rows)
    wait_for(f"job {job_id} in sacct / jobcomp", found, 30, poll_s=0.5)
    return rows[0]


def until_requeued(out_dir: str) -> int:
    """Job function: note each start; the first start waits to be requeued (bounded), a restart returns."""
    ctx = hetjob.context()
    if ctx.rank == 0:
        Path(out_dir, f"start-{ctx.restart_count}").write_text(f"{time.time()}")
    if ctx.restart_count == 0:
        threading.Event().wait(120)
        raise RuntimeError("not requeued within 120 s")
    return ctx.restart_count


def test_scontrol_requeue_restarts_het_job(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ex = HetSlurmExecutor(tmp_path / "submitit", components=[Component(partition="rollout")])
    ex.update_parameters(partition="train", nodes=1, ntasks_per_node=1, time=5, job_name="requeue",
                         additional_parameters={"requeue": True})
    job = ex.submit(until_requeued, str(out))
    wait_for("first start", lambda: (out / "start-0").exists(), 60)
    t0 = time.time()
    assert commands.requeue(job.job_id) == f"scontrol requeue {job.job_id}"
    # A second party's requeue (the hang watchdog and the leader's drain both requeue) finds it pending: done.
    assert "already pending" in commands.requeue(job.job_id)
    # On an idle test cluster the requeued het job would sit pending with Reason=None: kick each second.
    wait_for("restart after requeue", lambda: (out / "start-1").exists(), 90, on_poll=slurm_cluster.kick)
    restart_s = float((out / "start-1").read_text()) - t0
    assert job.results() == [1]
    assert commands.show_job(job.job_id)[0]["Restarts"] == "1"
    print(f"\nMEASURE requeue_to_restart_s={restart_s:.2f} (cred_expire=5, KillWait=5)")


def test_usr1_reaches_batch_shell_of_hand_template(slurm_cluster, tmp_path):
    run = tmp_path / "run dir"
    (run / "logs").mkdir(parents=True)
    (run / "control").mkdir()
    drain = run / "control" / "drain"
    waiter = 'for i in $(seq 600); do [ -e "$RLSLURM_RUN_DIR/control/drain" ] && exit 0; sleep 0.1; done; exit 3'
    script = tmp_path / "job.sbatch"
    script.write_text(render_template(
        job_name="usr1", train_partition="train", train_nodes=1, train_tasks_per_node=1,
        rollout_partition="rollout", rollout_nodes=1, rollout_tasks_per_node=1, time_min=5, signal_before_s=60,
        run_dir=str(run), log_file=str(run / "logs" / "slurm-%j.out"),
        train_command=["bash", "-c", waiter], rollout_command=["sleep", "120"]))
    job_id = commands.sbatch([str(script)])
    log = run / "logs" / f"slurm-{job_id}.out"
    wait_for("the batch shell to start", lambda: log.exists() and "start job=" in log.read_text(), 60)
    assert not drain.exists()
    commands.scancel(job_id, signal="USR1", batch=True)
    wait_for("USR1 to reach the batch shell", drain.exists, 20)
    wait_for("the job to finish", lambda: hetjob.job_states([job_id]).get(job_id, {}).get("State") == "COMPLETED", 60)
    assert "USR1: drain requested" in log.read_text()


def test_command_error_carries_command_exit_code_and_stderr(slurm_cluster):
    from rlslurm.errors import SlurmCommandError
    with pytest.raises(SlurmCommandError) as info:
        commands.show_job("999999")
    err = info.value
    assert err.argv == ("scontrol", "show", "job", "-o", "999999") and err.returncode == 1
    assert "Invalid job id" in err.stderr and "scontrol show job -o 999999" in str(err)
    assert commands.squeue(["999999"]) == []  # squeue's "Invalid job id" is an empty answer, not an error


def test_diag_keeps_slurms_reports_of_a_failed_het_job_and_reads_its_state(slurm_cluster, tmp_path):
    """The diag bundle's SLURM section (commands.job_report, parse.job_state) on a real failed het job."""
    from rlslurm.diag.bundle import slurm_facts

    script = tmp_path / "fails.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH -p train -n 1 -J fails\n#SBATCH hetjob\n#SBATCH -p rollout -n 1\n"
                      f"#SBATCH -o {tmp_path}/fails-%j.out\nsrun --het-group=0,1 true\nexit 3\n")
    job_id = commands.sbatch([str(script)])
    wait_for(f"job {job_id} FAILED", lambda: hetjob.job_states([job_id]).get(job_id, {}).get("State") == "FAILED", 60)
    texts, state = slurm_facts(job_id)
    assert state == "FAILED", texts
    assert texts["scontrol-show-job.txt"].startswith(f"$ scontrol show job {job_id}\n# exit 0\n"), texts
    shown = texts["scontrol-show-job.txt"]
    assert "Reason=NonZeroExitCode" in shown and "ExitCode=3:0" in shown
    assert "# exit 1\n" in texts["sacct.txt"] and "accounting storage is disabled" in texts["sacct.txt"], texts
    assert texts["sacct-c.txt"].startswith("$ sacct -c --parsable2"), texts
    missing, none = slurm_facts("999999")  # unknown to every source: evidence, not an exception
    assert none is None and "Invalid job id" in missing["scontrol-show-job.txt"]
