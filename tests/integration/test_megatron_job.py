"""`train.backend: megatron` end to end through `rlslurm submit` (local backend, 2 gloo ranks on CPU): SFT of
the embedded model on Megatron-core, GRPO from its HF export as the engine loads it, a drain mid-RL, and the
resume that continues it; the same guarantees the torch backend's tests hold it to.

    python -m pytest -q -s tests/integration/test_megatron_job.py     # ~5 min on 2 shared cores; -s prints the figures

- SFT: the Megatron trainer starts from the torch trainer's weights and learns its loss (the session's torch
  SFT of examples/tiny-sft.yaml, tests/integration/conftest.py): the first steps' losses agree to float
  precision; its checkpoints hold every rank's optimizer shard.
- RL learns: a short seeded GRPO run on Megatron, from the session's SFT export (an HF directory: the
  trainer converts it into Megatron's layout, the engine serves it as is), scores SFT's own held-out
  accuracy at step 0 and lifts it. (Megatron's own HF export is checked against transformers in
  test_megatron_model.py and served by vLLM in tests/vllm/test_vllm_megatron.py.)
- Drain, requeue, resume (SFT and RL): `rlslurm drain` mid-run checkpoints (every rank's shard of the distributed
  optimizer in the manifest) and stops the job (exit 75: off SLURM the requeue is `rlslurm resume`), and
  the resumed run makes the uninterrupted run's trajectory step for step.
Each run's Megatron step is real: Megatron's DDP, distributed optimizer and schedule over gloo
(rlslurm/megatron/device.py), so the RL loop's calls into MegatronPolicy (update with step_total, weights,
the checkpoint's shards) run here as they would on a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rl_runs import ROOT, WAIT_S, evals, steps, submit_example, trajectory
from rlslurm import launch
from rlslurm.checkpoint import latest_complete
from rlslurm.config import load_config
from rlslurm.events import read_events
from rlslurm.rundir import RunDir, read_jsonl
from waiting import wait_for

pytestmark = pytest.mark.slow

MEGATRON = ("train.backend=megatron", "memory.weight_bytes=4")
"""fp32 weights on CPU (bf16 would train too, but far from the fp32 engine's log-probs)."""
SFT_STEPS = 60
"""The uninterrupted Megatron SFT: the reference for the drained one's losses. It need not learn the task (the
RL runs start from the session's SFT export): a full SFT to the dev target on Megatron cost CI 4.5 min."""
RL_STEPS = 20
"""The uninterrupted RL run (the torch backend, from the avx2 SFT start of 0.336: 0.449 at step 20)."""
RL = (*MEGATRON, "rl.max_staleness=0", "rl.eval_every=4", "checkpoint.interval_steps=4")
MARGIN = 0.03
"""RL over SFT after 20 steps (measured before the SFT decay of issue 26: 0.345 -> 0.529, +0.184; seeded): a
drop, a stall or noise (a paired difference on the same 1000 problems: ~1-1.5 % standard error) stays under it."""


@pytest.fixture(scope="module")
def megatron_sft(tmp_path_factory) -> dict:
    """examples/tiny-sft.yaml on Megatron: {job, run_dir, eval (the sft_eval line), losses}."""
    job, run_dir = submit_example("tiny-sft.yaml", tmp_path_factory.mktemp("sft-megatron"),
                                  (*MEGATRON, f"train.steps={SFT_STEPS}", "task.eval_size=20"))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    (sft_eval,) = [r for r in rows if r.get("kind") == "sft_eval"]
    losses = {r["step"]: r["loss"] for r in rows if r.get("kind") == "sft_step"}
    print(f"\nMEASURE Megatron SFT: {job.train.steps} steps, held-out {sft_eval['held_out_accuracy']:.3f}, "
          f"{sft_eval['wall_s']:.1f} s")
    return {"job": job, "run_dir": run_dir, "eval": sft_eval, "losses": losses}


@pytest.fixture(scope="module")
def megatron_rl(sft, tmp_path_factory) -> dict:
    """The uninterrupted Megatron GRPO run from the session's SFT export: {job, run_dir, steps, evals}."""
    started = time.monotonic()
    job, run_dir = submit_example("tiny-grpo.yaml", tmp_path_factory.mktemp("rl-megatron"),
                                  (*RL, f"train.steps={RL_STEPS}", f"train.init_from={sft['export']}"))
    found = evals(run_dir)
    print(f"\nMEASURE Megatron RL: {' -> '.join(f'{a:.3f}@{s}' for s, a in found)} "
          f"({time.monotonic() - started:.1f} s submit -> done)")
    return {"job": job, "run_dir": run_dir, "steps": steps(run_dir), "evals": found}


def test_megatron_sft_starts_from_the_torch_weights_and_learns_the_torch_loss(megatron_sft, sft):
    torch_losses = {r["step"]: r["loss"] for r in read_jsonl(sft["run_dir"] / "metrics.jsonl")
                    if r.get("kind") == "sft_step"}
    ours = megatron_sft["losses"]
    assert sorted(ours) == list(range(1, SFT_STEPS + 1)) and megatron_sft["eval"]["step"] == SFT_STEPS
    dev = [r for r in read_jsonl(megatron_sft["run_dir"] / "metrics.jsonl") if r.get("kind") == "sft_dev"]
    assert [r["step"] for r in dev] == list(range(25, SFT_STEPS + 1, 25)), dev  # Megatron decodes its own weights
    gaps = [abs(ours[s] - torch_losses[s]) for s in range(1, 21)]
    assert max(gaps) < 1e-3, gaps  # the same start, data, loss and Adam: only the sums' order differs
    (start,) = read_events(RunDir(megatron_sft["run_dir"]), "sft_start")[:1]
    assert (start["backend"], start["device"]) == ("megatron", "cpu")
    # SFT's checkpoints hold Megatron's optimizer as every rank's shard
    files = latest_complete(RunDir(megatron_sft["run_dir"]), tidy=False).manifest["files"]
    assert {"optimizer-rank00000.pt", "optimizer-rank00001.pt"} <= set(files), files


def _drain_and_resume(sub, at_step: int, step_of) -> tuple[RunDir, dict]:
    """`rlslurm drain` once the run has made `at_step` steps (step_of(run_dir) says how many); the job
    checkpoints and exits 75 (off SLURM nothing requeues it); then `rlslurm resume --wait` runs it to the end.
    Returns (run, the `drained` event)."""
    run = RunDir(sub.run_dir)
    wait_for(f"step {at_step}", lambda: step_of(sub.run_dir) >= at_step, timeout_s=WAIT_S)
    asked = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "drain", str(sub.run_dir), "--reason", "test"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    codes = [int(c) for c in launch.wait(sub, timeout_s=WAIT_S, poll_s=0.5)]
    assert codes == [75, 75], codes
    (drained,) = read_events(run, "drained")
    ckpt = latest_complete(run, tidy=False)
    assert ckpt.step == drained["step"]
    assert {"optimizer-rank00000.pt", "optimizer-rank00001.pt"} <= set(ckpt.manifest["files"])
    resumed = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "resume", str(sub.run_dir), "--wait"],
                             capture_output=True, text=True, timeout=WAIT_S, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (resume,) = read_events(run, "resume")
    assert resume["step"] == drained["step"]
    return run, drained


def _submit(example: str, run_root, overrides: tuple[str, ...]):
    path = ROOT / "examples" / example
    return launch.submit(load_config(path, overrides), config_text=path.read_text(), backend="local",
                         run_root=run_root)


def test_sft_drained_and_resumed_makes_the_uninterrupted_losses(megatron_sft, tmp_path):
    """The SFT job's own checkpoint (HF weights, every rank's Adam shard, step, RNG) brings it back exactly:
    steps 1-60 of a run drained at step >= 20 are the uninterrupted run's (constant lr after warmup: the
    schedule does not depend on train.steps)."""
    steps_wanted = 60
    sub = _submit("tiny-sft.yaml", tmp_path, (*MEGATRON, f"train.steps={steps_wanted}", "task.eval_size=20"))

    def sft_steps(run_dir) -> int:
        return max((r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "sft_step"),
                   default=0)

    run, drained = _drain_and_resume(sub, 20, sft_steps)
    assert 20 <= drained["step"] < steps_wanted
    ours = {r["step"]: r["loss"] for r in read_jsonl(run.metrics) if r.get("kind") == "sft_step"}
    assert sorted(ours) == list(range(1, steps_wanted + 1))
    assert ours == {s: megatron_sft["losses"][s] for s in ours}


def test_megatron_rl_starts_from_the_export_as_the_engine_loads_it_and_learns(sft, megatron_rl):
    sft_accuracy = sft["eval"]["held_out_accuracy"]
    # The engine (transformers, fp32) serving the export scores SFT's own number at step 0.
    assert megatron_rl["evals"][0] == (0, sft_accuracy)
    last_step, rl_accuracy = megatron_rl["evals"][-1]
    assert last_step == RL_STEPS
    assert rl_accuracy >= sft_accuracy + MARGIN, f"RL {rl_accuracy:.3f} vs SFT {sft_accuracy:.3f}"
    rows = megatron_rl["steps"]
    assert len(rows) == RL_STEPS and all(r["effective_samples"] > 0 for r in rows)
    rewards = [r["reward_mean"] for r in rows]
    assert sum(rewards[-5:]) > sum(rewards[:5]), rewards
    # The engine sampled with the weights the Megatron trainer scores: a sync or a masking bug shows here.
    assert max(r["engine_trainer_logprob_gap"] for r in rows) < 1e-3
    metered = [r for r in rows if r["mem_metered"]]  # the live-tensor meter: step 1 and every 25th on the CPU
    assert metered and all(r["trainer_peak_gb"] > 0 and r["rss_peak_gb"] > 0 for r in metered)


def test_drain_mid_rl_resumes_to_the_uninterrupted_trajectory(sft, megatron_rl, tmp_path):
    steps_wanted = 8
    sub = _submit("tiny-grpo.yaml", tmp_path,
                  (*RL, f"train.steps={steps_wanted}", f"train.init_from={sft['export']}"))
    run, drained = _drain_and_resume(sub, 3, lambda run_dir: max((r["step"] for r in steps(run_dir)), default=0))
    assert 3 <= drained["step"] < steps_wanted
    ours, reference = trajectory(sub.run_dir), trajectory(megatron_rl["run_dir"])
    assert sorted(ours) == list(range(1, steps_wanted + 1))
    assert ours == {s: reference[s] for s in ours}  # Adam's shards restored: the same steps after the resume
    print(f"\nMEASURE Megatron RL drained at step {drained['step']}, resumed to {steps_wanted}: trajectory equal")
