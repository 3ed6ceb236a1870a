"""`rlslurm diag` on run directories of real runs: finished, failed, hung and running.

Each run is made by real processes under the phase guard (the hung one: 2 gloo ranks, one stalled,
caught by the watchdog); the summary must name the right cause, and secrets planted in the env
fingerprint, the config and the logs must appear nowhere in the extracted tarball.

This file is also the rank program: `python tests/integration/test_hang_diag.py RUN_DIR ok|fail|run`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from click.testing import CliRunner

from rlslurm.cli.diag import command as diag_command
from rlslurm.diag.bundle import collect
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.heartbeat import read_heartbeats
from rlslurm.diag.watchdog import Watchdog
from rlslurm.rundir import RunDir

HF = "hf_PlantedFingerprintToken0123456789"
SK = "sk-proj-PlantedConfigSecret1234567890"
PASSWORD = "correct-horse-9-battery"
AWS = "AKIAPLANTEDKEY123456"
BEARER = "plantedbearer.abc123xyz"
SECRETS = (HF, SK, PASSWORD, AWS, BEARER)
CONFIG = f"""
job: {{name: planted}}
sync: {{method: disk}}
reward: {{judge_api_key: {SK}}}
database: {{password: {PASSWORD}}}
diag: {{heartbeat_interval_s: 0.2, hang_timeout_s: 3, watch_interval_s: 0.25, hang_policy: dump}}
"""


def rank_main(run_dir: str, mode: str) -> None:
    from rlslurm.diag.env_diff import write_fingerprint
    from rlslurm.diag.guard import PhaseGuard

    run = RunDir(Path(run_dir))
    write_fingerprint(run, "train", 0)
    print(f"downloading with {HF}; db at postgres://rl:{PASSWORD}@db/rl using {PASSWORD}", flush=True)
    print(f"Authorization: Bearer {BEARER}  aws {AWS}", flush=True)
    guard = PhaseGuard(run, "train", 0, DiagConfig(heartbeat_interval_s=0.2, hang_timeout_s=30))
    with guard:
        for step in range(3 if mode != "run" else 10**9):
            with guard.phase("train", step=step):
                if mode == "fail" and step == 2:
                    raise ValueError(f"bad batch at step {step}")
                time.sleep(0.05)
                guard.beat()
    print("done", flush=True)


def _spawn(run: RunDir, args: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "TORCH_HUB_TOKEN": HF, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("SLURMD_NODENAME", None)
    # Append mode: the hung test writes a planted line into rank 0's log while the rank writes to it too.
    return subprocess.Popen([sys.executable, *args], env=env, stdout=open(run.logs / name, "a"),
                            stderr=subprocess.STDOUT)


def _new_run(tmp_path: Path, name: str) -> RunDir:
    run = RunDir(tmp_path / name).create()
    run.config.write_text(CONFIG)
    return run


def _check(bundle, tmp_path: Path) -> dict[str, str]:
    """Extract the bundle; no planted secret may be in any file of it."""
    out = tmp_path / f"x-{bundle.path.name}"
    with tarfile.open(bundle.path) as tar:
        tar.extractall(out, filter="data")
    files = {str(p.relative_to(out)).split("/", 1)[1]: p.read_text() for p in out.rglob("*") if p.is_file()}
    for name, text in files.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} leaked into {name}"
    assert "<redacted>" in files["logs/train-0.log.tail"] and "<redacted>" in files["run/config.yaml"]
    assert "<redacted>" in files["env/train-0.json"]
    return files


def test_finished_run_found_by_job_id(tmp_path):
    run = _new_run(tmp_path, "finished")
    run.record_start(job_id="5550", restart=0)
    assert _spawn(run, [__file__, str(run.path), "ok"], "train-0.log").wait(60) == 0
    bundle = collect("5550", run_root=tmp_path, out_dir=tmp_path, slurm=False)
    assert bundle.causes[0].kind == "finished" and "cause: finished OK" in bundle.summary
    files = _check(bundle, tmp_path)
    assert "train-0" in files["heartbeats.txt"] and "exited" in files["heartbeats.txt"]
    assert "env-diff: all fingerprints agree" in files["env-diff.txt"]


def test_failed_run_names_the_exception_with_its_traceback(tmp_path):
    run = _new_run(tmp_path, "failed")
    assert _spawn(run, [__file__, str(run.path), "fail"], "train-0.log").wait(60) == 1
    r = CliRunner().invoke(diag_command, [str(run.path), "--out", str(tmp_path), "--no-slurm"])
    assert r.exit_code == 0, r.output
    assert "cause: Python exception in train-0 during phase train step 2: ValueError: bad batch at step 2" in r.output
    assert "raise ValueError" in r.output  # the traceback is in the evidence
    bundle_path = r.output.split("bundle: ")[1].strip()
    files = _check(type("B", (), {"path": Path(bundle_path)})(), tmp_path)
    assert "Traceback (most recent call last)" in files["logs/train-0.log.tail"]


def test_running_run_gets_a_live_stack_dump(tmp_path):
    run = _new_run(tmp_path, "running")
    p = _spawn(run, [__file__, str(run.path), "run"], "train-0.log")
    try:
        deadline = time.monotonic() + 30
        while not any((hb.get("step") or 0) >= 3 for hb in read_heartbeats(run)) and time.monotonic() < deadline:
            time.sleep(0.1)
        bundle = collect(run.path, out_dir=tmp_path)
        assert bundle.causes[0].kind == "running" and "still running" in bundle.summary
        files = _check(bundle, tmp_path)
        (live,) = [v for k, v in files.items() if k.startswith("stacks/live-")]
        assert "rank_main" in live
    finally:
        p.kill()
        p.wait()


def test_hung_run_names_the_collective_and_the_stuck_rank(tmp_path):
    run = _new_run(tmp_path, "hung")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hang_program = str(Path(__file__).with_name("test_hang_watchdog.py"))
    procs = [_spawn(run, [hang_program, str(run.path), "2"], f"train-{rank}.log",
                    {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(2)]
    try:
        with open(run.logs / "train-0.log", "a") as f:  # the log of rank 0 carries a planted secret too
            f.write(f"token {HF} password={PASSWORD}\n")
        write_fp = [sys.executable, "-c", "import sys; from pathlib import Path; from rlslurm.rundir import RunDir; "
                    "from rlslurm.diag.env_diff import write_fingerprint; "
                    "write_fingerprint(RunDir(Path(sys.argv[1])), 'train', 0)",
                    str(run.path)]
        subprocess.run(write_fp, check=True, env={**os.environ, "TORCH_HUB_TOKEN": HF})
        dog = Watchdog(run, DiagConfig(heartbeat_interval_s=0.2, hang_timeout_s=3, watch_interval_s=0.25,
                                       hang_policy="dump"))
        deadline = time.monotonic() + 40
        while not dog.reports and time.monotonic() < deadline:
            dog.poll()
            time.sleep(0.25)
        assert dog.reports, read_heartbeats(run)
        bundle = collect(run.path, out_dir=tmp_path)
        assert bundle.causes[0].kind == "hang"
        assert "hang in collective all_reduce on ranks train-0, waiting on train-1" in bundle.summary
        files = _check(bundle, tmp_path)
        assert sum(k.startswith("stacks/live-") for k in files) == 2
        assert any("all_reduce" in v for k, v in files.items() if k.startswith("stacks/2"))
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
