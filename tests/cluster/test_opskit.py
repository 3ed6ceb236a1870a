"""The operations kit on the real local Slurm: the toy job (jobs/toytrain.py, 2 DDP ranks over gloo under
the phase guard, with the node agent of jobs/entry.py beside them) stalled, stopped, failed, drained and
diagnosed, each the way a user would meet it.

    RLSLURM_SLURM_PORT_BASE=20817 python -m pytest -q -s tests/cluster/test_opskit.py   # -s: MEASURE lines

- a rank stalled in its data phase (time.sleep in C) and a SIGSTOPped rank: the agent catches each within
  the phase timeout + 5 s, dumps every rank's stack into the run directory (the waiting rank in
  all_reduce), names the stalled rank and its phase, requeues the job (the default hang_policy), and the
  job resumes from its last complete checkpoint and ends with the uninterrupted run's weights;
- `rlslurm diag <jobid>` on a finished, a failed, a hung and a running job: the summary names the cause;
  secrets planted in the environment, the config and the sbatch options are in no member of the tarball;
- `rlslurm drain <jobid>`: drain, checkpoint, requeue, resume, same result as the uninterrupted run;
- a planted torch difference between a train and a rollout fingerprint of a real run: `rlslurm envdiff`
  refuses broadcast sync, names the odd rank out and points at disk sync;
- no node agent outlives its job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import yaml
from click.testing import CliRunner

import spine_util as su
from rlslurm.checkpoint import step_dirname
from rlslurm.cli.main import cli
from rlslurm.diag.env_diff import compare, read_fingerprints
from rlslurm.jobs.toytrain import ECHO_ENV, FAIL_ENV, STALL_ENV
from rlslurm.rundir import RunDir
from spine_util import INTERVAL, STEPS

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 150
"""Bound on one toy job, requeues included."""
TIMEOUT_S = 5.0
"""Phase timeout of the hang jobs (data, train, and between phases): small, and still far above a toy step."""
HANG_DIAG = {"heartbeat_interval_s": 0.5, "hang_timeout_s": TIMEOUT_S, "watch_interval_s": 0.5,
             "kill_grace_s": 3.0,
             # Start (imports, rendezvous, checkpoint load) and saves may be slow on 2 shared cores: only
             # the phases a stall is planted in get the small timeout. hang_policy stays the default.
             "phase_timeouts_s": {"start": 120, "checkpoint": 60}}

HF = "hf_PlantedSlurmToken0123456789abcd"
AKID = "AKIAPLANTEDSLURM0123"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/PlantedSecret0123"
PASSWORD = "Planted-Passw0rd-4-judge"
SECRETS = (HF, AKID, AWS_SECRET, PASSWORD)
SECRET_ENV = {"HF_TOKEN": HF, "AWS_ACCESS_KEY_ID": AKID, "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
              ECHO_ENV: "HF_TOKEN,AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY"}
"""sbatch exports the submitter's environment; the toy job echoes these to its log like an `env` line."""
SECRET_CONFIG = {"reward": {"endpoint": f"https://judge:{PASSWORD}@judge.internal/v1"},
                 "cluster": {"extra_sbatch": [f"--comment=aws_key={AKID}"]}}
"""A password in a URL of the config, an AWS key in an sbatch option (scontrol and the script show it)."""


def ops_config(path: Path, run_root: Path, *, step_delay_s: float = 0.2, diag: dict | None = None,
               secrets: bool = False) -> Path:
    """The spine's toy job (spine_util.toy_config) plus a diag section and the planted config secrets."""
    su.toy_config(path, run_root, step_delay_s=step_delay_s)
    data = yaml.safe_load(path.read_text())
    if diag:
        data["diag"] = diag
    if secrets:
        for section, values in SECRET_CONFIG.items():
            data.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def submit_with_env(config: Path, env: dict[str, str]):
    """Submit with extra environment for the job (sbatch exports it), then put this process's back."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        return su.submit(config)


def diag(target: str, run_root: Path, out: Path) -> tuple[str, Path]:
    """`rlslurm diag TARGET --run-root R --out O`: its printed summary and the bundle's path."""
    result = CliRunner().invoke(cli, ["diag", target, "--run-root", str(run_root), "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output, Path(re.search(r"^bundle: (.+)$", result.output, re.MULTILINE).group(1))


def assert_no_secret_in(bundle: Path) -> int:
    """Every member of the tarball, names and bytes, is free of every planted secret; returns the count."""
    with tarfile.open(bundle) as tar:
        members = tar.getmembers()
        for member in members:
            data = tar.extractfile(member).read() if member.isfile() else b""
            for secret in SECRETS:
                assert secret not in member.name and secret.encode() not in data, \
                    f"{secret!r} leaked into {member.name} of {bundle}"
    return len(members)


def member(bundle: Path, suffix: str) -> str:
    """The text of the one member whose name ends with `suffix`."""
    with tarfile.open(bundle) as tar:
        (m,) = [m for m in tar.getmembers() if m.name.endswith(suffix)]
        return tar.extractfile(m).read().decode()


def members_under(bundle: Path, folder: str) -> str:
    """The texts of every member under `folder` (e.g. "/logs/"), joined."""
    with tarfile.open(bundle) as tar:
        return "".join(tar.extractfile(m).read().decode() for m in tar.getmembers() if folder in m.name
                       and m.isfile())


def planted_in_run(run: Path) -> set[str]:
    """Which secrets the job really wrote into its run directory (so the bundle test proves something)."""
    found = set()
    for path in run.rglob("*"):
        if path.is_file() and "checkpoints" not in path.parts:
            text = path.read_bytes()
            found |= {s for s in SECRETS if s.encode() in text}
    return found


@pytest.fixture(scope="module")
def failed_job(slurm_cluster, tmp_path_factory):
    """Submitted with the reference (it runs on the other train node): rank 0 raises at step 6."""
    root = tmp_path_factory.mktemp("failed")
    config = ops_config(root / "failed.yaml", root / "runs", secrets=True)
    return submit_with_env(config, {**SECRET_ENV, FAIL_ENV: "6"}), root


@pytest.fixture(scope="module")
def reference(slurm_cluster, failed_job, tmp_path_factory):
    """The uninterrupted run (planted secrets and all): the numbers every interrupted run must end with."""
    root = tmp_path_factory.mktemp("reference")
    sub = submit_with_env(ops_config(root / "reference.yaml", root / "runs", step_delay_s=0.05, secrets=True),
                          SECRET_ENV)
    su.wait_done(sub.job_id, sub.run_dir, JOB_TIMEOUT_S, slurm_cluster.kick)
    assert sorted(su.losses(sub.run_dir)) == list(range(1, STEPS + 1))
    return sub, root


def _hang(run: Path) -> dict:
    su.wait_for(f"a hang_detected event in {run.name}", lambda: su.events(run, "hang_detected"), JOB_TIMEOUT_S,
                poll_s=0.1)
    (hang,) = su.events(run, "hang_detected")
    return hang


def _stacks(hang: dict) -> dict[str, str]:
    """rank name -> its stack dump file's text, from the dump directory the hang event names."""
    stacks = Path(hang["stacks_dir"])
    assert stacks.parent == stacks.parent.parent / "stacks" and stacks.is_dir()
    return {re.sub(r"^n\d+-", "", p.stem): p.read_text() for p in stacks.iterdir()}


def _resumed_like_reference(slurm_cluster, sub, reference, since_t: float, step_at_fault: int, name: str):
    su.wait_done(sub.job_id, sub.run_dir, JOB_TIMEOUT_S, slurm_cluster.kick)
    run = sub.run_dir
    (action,) = su.events(run, "hang_action")
    assert action["action"] == "requeue" and action["requeue"].startswith(f"scontrol requeue {sub.job_id}"), action
    (resume,) = su.events(run, "resume")
    assert resume["restart_count"] == 1 and step_at_fault - INTERVAL <= resume["step"] <= step_at_fault, resume
    assert resume["checkpoint"] == step_dirname(resume["step"])
    assert su.losses(run) == su.losses(reference.run_dir)
    assert su.final_sha(run) == su.final_sha(reference.run_dir)
    timing = su.restart_timing(run, action["t"], 1)
    print("\n" + su.measure_line(name, timing) + f" [fault at step {step_at_fault}, resumed at {resume['step']}]")
    return resume


def test_stalled_rank_is_caught_within_timeout_dumped_requeued_and_resumed(slurm_cluster, reference, tmp_path):
    ref, _ = reference
    root = tmp_path
    sub = submit_with_env(ops_config(root / "stall.yaml", root / "runs", diag=HANG_DIAG), {STALL_ENV: "1@10:sleep"})
    run = sub.run_dir
    hang = _hang(run)
    (fault,) = su.events(run, "fault_injected")
    latency = hang["t"] - fault["t"]
    assert latency <= TIMEOUT_S + 5, f"hang detected {latency:.1f} s after the stall"

    # Diagnosed while hung: the requeued start is at least KillWait + cred_expire away.
    out, bundle = diag(sub.job_id, root / "runs", root)
    assert "cause: hang in collective all_reduce on ranks train-0, waiting on train-1" in out, out
    assert not su.events(run, "resume"), "diag came too late to see the hung attempt"

    assert hang["stuck"] == ["train-1"] and hang["waiting"] == ["train-0"], hang
    assert hang["collective"] == "all_reduce" and hang["policy"] == "requeue"
    assert "train-1 in the data phase step 10 at Faults.stall" in hang["message"], hang["message"]
    assert "1 rank in all_reduce of train step 10 (train-0)" in hang["message"], hang["message"]
    stacks = _stacks(hang)
    assert sorted(stacks) == ["train-0", "train-1"]
    # DDP all-reduces gradients inside backward(): the stack shows its reducer waiting, the head says so.
    assert "waiting in all_reduce" in stacks["train-0"] and "c10d::Reducer::finalize_backward" in stacks["train-0"]
    assert "Faults.stall" in stacks["train-1"] and "all_reduce" not in stacks["train-1"]
    assert member(bundle, "/stacks/" + Path(hang["stacks_dir"]).name + f"/{hang['host']}-train-1.txt")

    resume = _resumed_like_reference(slurm_cluster, sub, ref, hang["t"], 10, "hang (stall) -> requeue")
    assert resume["step"] == 8  # the last periodic checkpoint (interval 4) before the stall in step 10
    print(f"MEASURE stall detection on SLURM: {latency:.2f} s after the stall "
          f"(phase timeout {TIMEOUT_S:g} s, watch interval {HANG_DIAG['watch_interval_s']} s)")


def test_sigstopped_rank_is_caught_within_timeout_dumped_requeued_and_resumed(slurm_cluster, reference, tmp_path):
    ref, _ = reference
    sub = su.submit(ops_config(tmp_path / "sigstop.yaml", tmp_path / "runs", step_delay_s=0.3, diag=HANG_DIAG))
    run = sub.run_dir
    su.wait_for("step 6", lambda: su.last_step(run) >= 6, JOB_TIMEOUT_S)
    hb = json.loads((run / "heartbeats" / "train-1.json").read_text())
    assert hb["job_id"] == sub.job_id and hb["state"] == "running"
    os.kill(hb["pid"], signal.SIGSTOP)
    stopped_at, step_at_stop = time.time(), su.last_step(run)
    hang = _hang(run)
    latency = hang["t"] - stopped_at
    assert latency <= TIMEOUT_S + 5, f"hang detected {latency:.1f} s after SIGSTOP"
    assert hang["stuck"] == ["train-1"] and hang["waiting"] == ["train-0"], hang
    assert hang["collective"] == "all_reduce"
    assert "process stopped (state T)" in hang["message"], hang["message"]
    # Its phase as its last heartbeat write had it: the flusher stopped with it, and under load it lags
    # a step or two (CI saw "in the checkpoint phase step 4" with train-0 past step 6).
    assert re.search(r"train-1 (in the (data|train|checkpoint) phase|between phases after) step \d+",
                     hang["message"]), hang["message"]
    (stuck,) = [r for r in hang["ranks"] if r["rank"] == "train-1"]
    assert stuck["state"] == "stopped" and stuck["pid"] == hb["pid"]
    stacks = _stacks(hang)
    assert "stopped (state T)" in stacks["train-1"] and "py-spy --nonblocking" in stacks["train-1"]
    assert "all_reduce" in stacks["train-0"]
    _resumed_like_reference(slurm_cluster, sub, ref, hang["t"], step_at_stop + 1, "hang (SIGSTOP) -> requeue")
    print(f"MEASURE SIGSTOP detection on SLURM: {latency:.2f} s after the signal (phase timeout {TIMEOUT_S:g} s)")


def test_diag_of_a_finished_job_says_so_and_leaks_no_secret(reference, tmp_path):
    ref, root = reference
    assert planted_in_run(ref.run_dir) == set(SECRETS), "the job did not write every planted secret"
    out, bundle = diag(ref.job_id, root / "runs", tmp_path)
    assert "cause: finished OK" in out and f"job: {ref.job_id}, SLURM state COMPLETED" in out, out
    assert assert_no_secret_in(bundle) > 10
    assert "<redacted>" in member(bundle, "/run/config.yaml")
    assert "HF_TOKEN=<redacted>" in members_under(bundle, "/logs/")  # the echoed line, scrubbed


def test_diag_of_a_failed_job_names_the_exception_and_leaks_no_secret(slurm_cluster, failed_job, tmp_path):
    sub, root = failed_job
    su.wait_for(f"job {sub.job_id} FAILED", lambda: su.state(sub.job_id) == "FAILED", JOB_TIMEOUT_S, poll_s=0.5)
    assert planted_in_run(sub.run_dir) == set(SECRETS)
    out, bundle = diag(sub.job_id, root / "runs", tmp_path)
    assert ("cause: Python exception in train-0 during phase train step 6: RuntimeError: toy fault: rank 0 "
            "raises in the train phase of step 6") in out, out
    assert "SLURM state FAILED" in out
    assert assert_no_secret_in(bundle) > 10


def test_drain_cli_on_a_running_job_checkpoints_requeues_and_resumes_to_the_same_result(
        slurm_cluster, reference, tmp_path):
    ref, _ = reference
    sub = su.submit(ops_config(tmp_path / "drain.yaml", tmp_path / "runs", step_delay_s=0.5))
    run = sub.run_dir
    su.wait_for("step 3", lambda: su.last_step(run) >= 3, JOB_TIMEOUT_S)
    out, bundle = diag(sub.job_id, tmp_path / "runs", tmp_path)
    assert re.search(r"cause: still running \(step \d+; train-0 in \w+, train-1 in \w+\)", out), out
    # The ranks' heartbeats name node n1, not this host: their live stacks came through an srun --overlap
    # step into the job, py-spy on the node, as on a cluster whose nodes the login node cannot reach.
    with tarfile.open(bundle) as tar:
        live = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers()
                if "/stacks/live-" in m.name and m.isfile()}
    for rank in ("train-0", "train-1"):
        text = live[f"{rank}.txt"]
        assert "on n1 by py-spy" in text and "in `srun --overlap` (job " in text and "Thread " in text, text
        assert "toytrain.py" in text, text  # the rank's own frames, not py-spy's or srun's

    result = CliRunner().invoke(cli, ["drain", sub.job_id, "--run-root", str(tmp_path / "runs"),
                                      "--reason", "node maintenance"], catch_exceptions=False)
    assert result.exit_code == 0 and "drain requested" in result.output, result.output
    step_at_request = su.last_step(run)
    su.wait_done(sub.job_id, run, JOB_TIMEOUT_S, slurm_cluster.kick)

    (cli_event,) = [e for e in su.events(run, "drain_requested") if e["role"] == "cli"]
    assert cli_event["job_id"] == sub.job_id and cli_event["reason"] == "node maintenance"
    (drained,) = su.events(run, "drained")
    assert drained["signal"] is None and drained["requeued"] is True and "control file" in drained["reason"]
    assert step_at_request <= drained["step"] < STEPS and drained["checkpoint"] == step_dirname(drained["step"])
    (resume,) = su.events(run, "resume")
    assert (resume["step"], resume["restart_count"]) == (drained["step"], 1)
    assert not (run / "control" / "drain").exists()  # consumed: the requeued start ran on
    assert su.losses(run) == su.losses(ref.run_dir)
    assert su.final_sha(run) == su.final_sha(ref.run_dir)
    (requeue,) = su.events(run, "requeue")
    print("\n" + su.measure_line("rlslurm drain", su.restart_timing(run, requeue["t"], 1)))


def test_envdiff_refuses_a_planted_torch_difference_between_train_and_rollout(reference, tmp_path):
    ref, _ = reference
    run = RunDir(tmp_path / "planted").create()
    for fp in (ref.run_dir / "env").glob("*.json"):  # the real fingerprints of the SLURM ranks
        shutil.copy(fp, run.env / fp.name)
    assert sorted(read_fingerprints(run.path)) == ["rollout-0", "train-0", "train-1"]
    assert compare(read_fingerprints(run.path)).ok
    rollout = json.loads((run.env / "rollout-0.json").read_text())
    rollout["torch"] = "2.12.0+planted"
    (run.env / "rollout-0.json").write_text(json.dumps(rollout))

    result = CliRunner().invoke(cli, ["envdiff", str(run.path)])
    assert result.exit_code == 3, result.output
    message = result.output
    assert "torch differs between train and rollout" in message and "rollout-0: 2.12.0+planted" in message
    assert "train-0, train-1: " in message and "sync.method = 'disk'" in message
    assert CliRunner().invoke(cli, ["envdiff", str(run.path), "--sync-method", "disk"]).exit_code == 0


def test_no_node_agent_outlives_its_job(reference, failed_job):
    """Runs last: every job of this module has ended; none of their node agents may still run."""
    runs = [str(run) for _, run in su.TRACKED]
    agents = [p for p in psutil.process_iter(["pid", "cmdline"]) if p.info["cmdline"]
              and "rlslurm.diag.watchdog" in p.info["cmdline"] and any(r in p.info["cmdline"] for r in runs)]
    assert not agents, [p.info["cmdline"] for p in agents]
    logs = [p for r in runs for p in (Path(r) / "logs").glob("watchdog-*.log")]
    assert logs and all(re.search(r"exiting: |hang action requeue", p.read_text()) for p in logs), \
        {p.name: p.read_text()[-300:] for p in logs}
