"""train.lora end to end on the embedded default (rlslurm/lora.py): GRPO from the SFT export with LoRA syncs the
adapters alone each step (the per-step sync bytes against the full model's), verified on the transformers
engine; a run stopped at a checkpoint and resumed makes the steps the uninterrupted run made; the checkpoint
holds the adapters alone; the RL and SFT exports are merged plain HF models transformers loads.

    python -m pytest -q tests/integration/test_lora_runs.py      # ~5-7 min on 2 cores (the SFT fixture first)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rl_runs import ROOT, steps, submit_example, trajectory
from rlslurm.checkpoint import latest_complete
from rlslurm.lora import is_adapter
from rlslurm.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.slow  # real SFT + RL runs: minutes on 2 cores

LORA = ("train.lora.rank=8", "train.lora.alpha=16")
SMALL = ("rl.prompts_per_step=16", "rl.eval_every=100", "rl.eval_rows=50", "rl.max_staleness=0",
         "checkpoint.interval_steps=2")


def _loads_in_transformers(export) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    assert not any(".lora_" in n or ".base_layer." in n for n in model.state_dict())
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 6, 7]])).logits).all()
    assert (export / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_grpo_syncs_the_adapters_resumes_and_exports_a_merged_model(sft, tmp_path):
    start = (f"train.init_from={sft['export']}", *SMALL)
    _, full = submit_example("tiny-grpo.yaml", tmp_path / "full", ("train.steps=1", *start))
    _, whole = submit_example("tiny-grpo.yaml", tmp_path / "whole", ("train.steps=6", *start, *LORA))
    _, run_dir = submit_example("tiny-grpo.yaml", tmp_path / "resumed", ("train.steps=4", *start, *LORA))

    full_bytes = steps(full)[0]["sync_update_bytes"]
    lora_bytes = {r["sync_update_bytes"] for r in steps(whole)}
    (adapter_bytes,) = lora_bytes  # every step the same: the adapters
    print(f"sync bytes per step: full {full_bytes}, LoRA rank 8 {adapter_bytes} "
          f"({adapter_bytes / full_bytes:.3f})", file=sys.stderr)
    assert adapter_bytes < full_bytes / 3
    assert all(r["sync_verify_s"] >= 0 and r["sync_attempts"] == 1 for r in steps(whole))

    ckpt = latest_complete(RunDir(run_dir))
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    assert tensors and all(is_adapter(n) for n in tensors)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == adapter_bytes

    resumed = subprocess.run([sys.executable, "-m", "rlslurm.cli.main", "resume", str(run_dir),
                              "--set", "train.steps=6", "--wait"], capture_output=True, text=True, timeout=400,
                             cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    ours, theirs = trajectory(run_dir), trajectory(whole)
    assert sorted(ours) == [1, 2, 3, 4, 5, 6] and ours == theirs
    assert [r["step"] for r in steps(whole)] == [1, 2, 3, 4, 5, 6]
    assert any(abs(r["loss"]) > 0 for r in steps(whole)) and all(r["grad_norm"] > 0 for r in steps(whole))
    _loads_in_transformers(run_dir / "export" / "hf")


def test_lora_sft_trains_the_adapters_and_exports_a_merged_model(sft, tmp_path):
    _, run_dir = submit_example("tiny-sft.yaml", tmp_path,
                                (f"train.init_from={sft['export']}", "train.steps=40", "train.stop_at_accuracy=null",
                                 "train.warmup_steps=0", "checkpoint.interval_steps=20", *LORA))
    tensors = load_file(str(latest_complete(RunDir(run_dir)).path / "model.safetensors"))
    assert tensors and all(is_adapter(n) for n in tensors)
    lines = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r and "step" in r]
    assert lines[-1]["loss"] < lines[0]["loss"]
    _loads_in_transformers(run_dir / "export" / "hf")
