"""The RL het job with `rollout.engine: vllm` on the real local Slurm: the trainer (2 ranks) on a `train` node,
vLLM's own OpenAI server (rlslurm/rollout/vllm_serve.py, from the rollout venv) as the rollout component on a
`rollout` node, broadcast sync through vLLM's RL routes into its worker, the rule reward inline.

    RLSLURM_SLURM_PORT_BASE=21817 python -m pytest -q -s tests/cluster/test_rl_vllm_slurm.py

What a user of the vLLM engine wants proven: the job ends COMPLETED; the engine the controller used is vLLM's
server, a child of the rollout task, on the rollout node (its process while it serves, its own log); every
weight version the trainer sent was VERIFIED in the engine (one sync_verified each, and one weight transfer
each in vLLM's worker log); each step trained on responses stamped with the version the trainer trained at,
which a verified sync had put in the engine; `rlslurm status` and `rlslurm diag` read the run.

vLLM's CPU attention needs a head size >= 32, so the model is the embedded one at 2 heads (64 / 2), trained
for a short SFT first so that GRPO groups have rewards to tell apart. vLLM starts in ~45 s here: one job.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil
import pytest
import yaml
from click.testing import CliRunner

import spine_util as su
import test_rl_slurm as rl  # the RL het job's config and checks, shared with the transformers engine's tests
from rlslurm import launch
from rlslurm.cli.main import cli
from rlslurm.config import load_config

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("RLSLURM_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
STEPS = 4
"""RL steps: each trains (the SFT start gives groups with mixed rewards), syncs and verifies a version."""
MODEL = {"hidden": 64, "heads": 2}
"""The embedded model with a head size of 32, the smallest vLLM's CPU attention serves."""


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory) -> Path:
    """A short SFT of examples/tiny-sft.yaml at MODEL's shape (local backend: only the starting point)."""
    path = ROOT / "examples" / "tiny-sft.yaml"
    job = load_config(path, ["train.steps=300", "task.eval_size=50",
                             *(f"model.{k}={v}" for k, v in MODEL.items())])
    sub = launch.submit(job, config_text=path.read_text(), backend="local",
                        run_root=tmp_path_factory.mktemp("sft"))
    assert [int(c) for c in launch.wait(sub, timeout_s=300, poll_s=0.5)] == [0, 0]
    return sub.run_dir / "export" / "hf"


def vllm_config(tmp_path: Path, init_from: Path) -> Path:
    """test_rl_slurm.py's separate-placement RL job, with the vLLM engine from the rollout venv."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"the vLLM engine needs the rollout venv, and {VLLM_PYTHON} does not exist: run "
                    "`bash sbatch/install_vllm_cpu.sh` (or set RLSLURM_VLLM_PYTHON), or deselect with -m 'not vllm'",
                    pytrace=False)
    path = rl.rl_config(tmp_path / "rl-vllm.yaml", tmp_path / "runs", init_from, method="broadcast", steps=STEPS)
    data = yaml.safe_load(path.read_text())
    data["model"] = MODEL
    data["rollout"].update(engine="vllm", python=str(VLLM_PYTHON))
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_rl_het_job_on_vllm_serve(slurm_cluster, sft_export, tmp_path):
    sub = su.submit(vllm_config(tmp_path, sft_export))
    run = sub.run_dir
    # While it serves (the start's sync verified): the announced engine is vLLM's OpenAI server, from the
    # rollout venv, whose parent is the rollout component's task.
    su.wait_for("the engine's first verified sync", lambda: su.events(run, "sync_verified"), rl.JOB_TIMEOUT_S,
                poll_s=0.25)
    # The rollout task announces "serving" once its own readiness poll sees vLLM's /health, which under load can
    # come after the controller's first sync through the same URL.
    engine = su.wait_for("the engine announced serving", lambda: (e := json.loads(
        (run / "endpoints" / "engine-0.json").read_text())).get("state") == "serving" and e, 60, poll_s=0.25)
    server = psutil.Process(engine["pid"])
    assert server.cmdline()[:3] == [str(VLLM_PYTHON), "-m", "rlslurm.rollout.vllm_api"], server.cmdline()
    (task,) = su.placements(run, "rollout")
    assert server.ppid() == task["pid"]
    su.wait_done(sub.job_id, run, rl.JOB_TIMEOUT_S, slurm_cluster.kick)

    rl.assert_separate_placement(run)  # COMPLETED; the trainer on a train node, the engine on a rollout node
    assert task["node"] == engine["node"] and engine["state"] == "serving"
    rl.assert_engines_exited_cleanly(run, starts=1)
    rl.assert_synced_every_step(run, "broadcast", total=STEPS)
    # vLLM's own log: its API server is the announced pid, its worker made rlslurm's transfer engine (the plugin)
    # and received one weight update per version the controller verified: 0 (the start) .. STEPS.
    served = (run / "logs" / "engine-0.log").read_text(errors="replace")
    (args,) = [line for line in served.splitlines() if line.startswith(f"(APIServer pid={engine['pid']})")
               and "non-default args:" in line]
    host, port = engine["url"].removeprefix("http://").rsplit(":", 1)
    expected = {"host": repr(host), "port": port, "model": repr(str(sft_export))}
    assert all(f"'{k}': {v}" in args for k, v in expected.items()), args
    assert "Creating weight transfer engine: RlslurmTransferEngine" in served
    assert len(re.findall(r"rlslurm weight transfer on TP rank 0: ", served)) == STEPS + 1
    # The samples each step trained on: every response stamped (vLLM's weight version) with the version the
    # trainer took them at, the version a verified sync had put in the engine before the step's rollout.
    verified = {e["version"]: e["t"] for e in su.events(run, "sync_verified")}
    rows = rl.steps(run)
    for m in rows:
        version = m["step"] - 1
        assert m["trained_at_version"] == version and m["response_versions"] == {str(version): m["samples"]}, m
        assert verified[version] < m["t"] - m["step_s"]
    assert sum(m["effective_samples"] for m in rows) > 0

    status = CliRunner().invoke(cli, ["status", sub.job_id, "--run-root", str(run.parent)], catch_exceptions=False)
    assert status.exit_code == 0, status.output
    assert "component 1: COMPLETED partition=rollout" in status.output and f"step {STEPS}/{STEPS}" in status.output
    diag = CliRunner().invoke(cli, ["diag", sub.job_id, "--run-root", str(run.parent), "--out", str(tmp_path / "diag"),
                                    "--no-live"], catch_exceptions=False)
    assert diag.exit_code == 0, diag.output
    assert "cause: finished OK" in diag.output, diag.output
    (done,) = su.events(run, "done")
    (submitted,) = su.events(run, "submitted")
    print(f"\nMEASURE RL het job on vLLM serve, sync broadcast: {done['t'] - submitted['t']:.1f} s submit -> done "
          f"({STEPS} steps, {sum(m['step_s'] for m in rows):.1f} s in steps, vLLM's start and first sync "
          f"{verified[0] - submitted['t']:.1f} s)")
