"""The GRPO family on the demo: plain GRPO, DAPO and Dr. GRPO (examples/tiny-{grpo,dapo,drgrpo}.yaml) from the same
SFT starts, each its held-out result, gain over SFT and samples/s; the mean over the seeds.

    python bench/bench_variants.py                                  # SFT per seed, then the three recipes from it
    python bench/bench_variants.py --sft-runs runs/a runs/b runs/c  # from finished SFT runs (seed = position)
    python bench/bench_variants.py --variants tiny-grpo tiny-dapo --seeds 0 --json-out /tmp/variants.json

Each run goes through `rlslurm submit --backend local --wait` as `make demo` runs it, with train.seed set (the
SFT's and the RL run's, so one seed is one start). Runs are sequential; the machine's 1-minute load at each run's
start is printed beside it (the CPUs are shared: seconds move with it, results do not). Columns: SFT held-out,
RL held-out (the last evaluation of rl.eval_rows = 1000 held-out problems, greedy), gain, effective samples/s (the
mean over steps of samples that reached the loss with a non-zero advantage, per second of the step), generated
responses/s (every response the engines made, dynamic sampling's extra rounds included, per second of the run's
steps), wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("tiny-grpo", "tiny-dapo", "tiny-drgrpo")


def _rlslurm() -> str:
    here = Path(sys.executable).with_name("rlslurm")
    return str(here) if here.exists() else "rlslurm"


def _submit(example: str, root: Path, sets: list[str]) -> tuple[Path, float]:
    argv = [_rlslurm(), "submit", f"examples/{example}.yaml", "--backend", "local", "--run-root", str(root), "--wait"]
    for s in sets:
        argv += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return max(root.glob(f"{example}-*"), key=lambda p: p.stat().st_mtime), wall


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def sft_start(seed: int, root: Path, given: Path | None) -> tuple[Path, float]:
    """(the SFT run, its held-out accuracy): a given finished run, or examples/tiny-sft.yaml at `seed`."""
    run = given if given is not None else _submit("tiny-sft", root / f"sft-{seed}", [f"train.seed={seed}"])[0]
    sft_eval = next(r for r in _metrics(run) if r.get("kind") == "sft_eval")
    return run, sft_eval["heldout_accuracy"]


def one(variant: str, seed: int, sft: Path, sft_acc: float, root: Path, sets: tuple[str, ...]) -> dict:
    load = os.getloadavg()[0]
    run, wall = _submit(variant, root / f"{variant}-{seed}",
                        [f"train.seed={seed}", f"train.init_from={sft / 'export' / 'hf'}", *sets])
    lines = _metrics(run)
    steps = [r for r in lines if "policy_version" in r]
    acc = [r for r in lines if "held_out_accuracy" in r][-1]["held_out_accuracy"]
    return {"variant": variant, "seed": seed, "sft": sft_acc, "rl": acc, "gain": acc - sft_acc,
            "eff_samples_per_s": statistics.mean(r["effective_samples_per_s"] for r in steps),
            "responses_per_s": sum(r["samples"] for r in steps) / sum(r["step_s"] for r in steps),
            "zero_variance_groups": sum(r["zero_variance_groups"] for r in steps) / len(steps),
            "ds_rounds": statistics.mean(r.get("ds_rounds", 1) for r in steps),
            "wall_s": wall, "load": load, "run": str(run)}


COLUMNS = (("variant", "{:<12}"), ("seed", "{:>4}"), ("sft", "{:>6.3f}"), ("rl", "{:>6.3f}"), ("gain", "{:>+7.3f}"),
           ("eff_samples_per_s", "{:>8.0f}"), ("responses_per_s", "{:>8.0f}"), ("zero_variance_groups", "{:>6.1f}"),
           ("ds_rounds", "{:>5.2f}"), ("wall_s", "{:>6.0f}"), ("load", "{:>5.1f}"))
HEADS = ("variant", "seed", "SFT", "RL", "gain", "eff/s", "resp/s", "zero-var", "rounds", "wall", "load")


def table(rows: list[dict], variants: list[str]) -> str:
    lines = ["| " + " | ".join(HEADS) + " |", "|" + "---|" * len(HEADS)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[k]).strip() for k, fmt in COLUMNS) + " |")
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        if mine:
            mean = {k: statistics.mean(r[k] for r in mine) for k, _ in COLUMNS[2:]}
            lines.append("| " + " | ".join([f"**{v}** mean", f"{len(mine)} seeds"] + [
                fmt.format(mean[k]).strip() for k, fmt in COLUMNS[2:]]) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--sft-runs", nargs="+", type=Path, default=None,
                        help="finished examples/tiny-sft.yaml runs, one per seed in --seeds order")
    parser.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench-variants")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of every variant's config, as `rlslurm submit --set` (repeatable)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    if args.sft_runs and len(args.sft_runs) != len(args.seeds):
        parser.error(f"--sft-runs gives {len(args.sft_runs)} runs for {len(args.seeds)} seeds")
    rows = []
    for i, seed in enumerate(args.seeds):
        sft, sft_acc = sft_start(seed, args.run_root, args.sft_runs[i] if args.sft_runs else None)
        for variant in args.variants:
            rows.append(one(variant, seed, sft, sft_acc, args.run_root, tuple(args.set)))
            print(table(rows[-1:], []).splitlines()[-1], flush=True)
            if args.json_out:
                args.json_out.write_text(json.dumps(rows, indent=1))
    print(table(rows, args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
