"""The main job's learning result as a spread: SFT -> GRPO of the demo across CPU kernel paths and seeds.

    python bench/bench_learning.py                     # every kernel path this CPU has x seeds 0 1 2
    python bench/bench_learning.py --caps default avx2 --seeds 0 1 2 --json-out /tmp/learning.json

One row per (ATEN_CPU_CAPABILITY, train.seed): examples/tiny-sft.yaml, then examples/tiny-grpo.yaml from its
export, both through `rlslurm submit --backend local --wait` exactly as `make demo` runs them, with the
seed set on both. torch picks its CPU kernels by ATEN_CPU_CAPABILITY (default = no SIMD, avx2, avx512); a
path the CPU lacks is skipped (torch would fall back silently). The rounding of one path against another
moves where SFT lands on its learning curve, which is why the recipe stops SFT at a dev-split target
(train.stop_at_accuracy) rather than a step count; this bench shows what that leaves.

Printed: SFT steps, SFT held-out, RL held-out (its last evaluation), gain, wall seconds per stage, then the
min-max of each column. Runs are sequential; the machine's load at the time is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_caps() -> list[str]:
    """The kernel paths this CPU can run: default always, avx2 / avx512 where /proc/cpuinfo has them."""
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    caps = ["default"]
    if {"avx2", "fma"} <= flags:
        caps.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        caps.append("avx512")
    return caps


def _rlslurm() -> str:
    here = Path(sys.executable).with_name("rlslurm")
    return str(here) if here.exists() else "rlslurm"


def _submit(example: str, root: Path, cap: str, sets: list[str]) -> tuple[Path, float]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    argv = [_rlslurm(), "submit", f"examples/{example}", "--backend", "local", "--run-root", str(root), "--wait"]
    for s in sets:
        argv += ["--set", s]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    name = example.removesuffix(".yaml")
    run = max(root.glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
    return run, wall


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _done_sft(root: Path) -> Path | None:
    """The newest finished SFT run under `root` (its sft_eval line written), or None."""
    runs = [r for r in sorted(root.glob("tiny-sft-*")) if (r / "metrics.jsonl").exists()
            and any(m.get("kind") == "sft_eval" for m in _metrics(r))]
    return runs[-1] if runs else None


def one(cap: str, seed: int, root: Path, reuse_sft: bool = False, rl_sets: tuple[str, ...] = ()) -> dict:
    """SFT then GRPO at one kernel path and seed: the row of the table. `reuse_sft`: GRPO from the SFT run this
    root already holds for (cap, seed), when there is one (its wall seconds then read as 0); `rl_sets`: GRPO's
    config overrides, tried against the same SFT runs."""
    load = os.getloadavg()[0]
    sft = _done_sft(root / f"{cap}-{seed}") if reuse_sft else None
    if sft is not None:
        sft_s = 0.0
    else:
        sft, sft_s = _submit("tiny-sft.yaml", root / f"{cap}-{seed}", cap, [f"train.seed={seed}"])
    sft_eval = next(r for r in _metrics(sft) if r.get("kind") == "sft_eval")
    rl, rl_s = _submit("tiny-grpo.yaml", root / f"{cap}-{seed}", cap,
                       [f"train.seed={seed}", f"train.init_from={sft / 'export' / 'hf'}", *rl_sets])
    evals = [r for r in _metrics(rl) if "held_out_accuracy" in r]
    rl_acc = evals[-1]["held_out_accuracy"]
    return {"cap": cap, "seed": seed, "sft_steps": sft_eval["step"], "sft": sft_eval["held_out_accuracy"],
            "rl": rl_acc, "gain": rl_acc - sft_eval["held_out_accuracy"], "sft_s": sft_s, "rl_s": rl_s,
            "load": load, "sft_run": str(sft), "rl_run": str(rl)}


COLUMNS = (("cap", "{:<8}"), ("seed", "{:>4}"), ("sft_steps", "{:>9}"), ("sft", "{:>8.3f}"), ("rl", "{:>8.3f}"),
           ("gain", "{:>+7.3f}"), ("sft_s", "{:>7.1f}"), ("rl_s", "{:>7.1f}"), ("load", "{:>5.1f}"))


def table(rows: list[dict]) -> str:
    head = "  ".join(f"{name:>{len(fmt.format(0) if name != 'cap' else 'default ')}}" for name, fmt in COLUMNS)
    lines = [head]
    for r in rows:
        lines.append("  ".join(fmt.format(r[name]) for name, fmt in COLUMNS))
    if rows:
        spread = {k: (min(r[k] for r in rows), max(r[k] for r in rows))
                  for k in ("sft_steps", "sft", "rl", "gain", "sft_s", "rl_s")}
        lines.append("spread (min-max): " + ", ".join(
            f"{k} {lo:.3g}-{hi:.3g}" for k, (lo, hi) in spread.items()))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", nargs="+", default=None, help="kernel paths (default: every one this CPU has)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench-learning")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--reuse-sft", action="store_true",
                        help="GRPO from the SFT run already under --run-root for each (path, seed): SFT does not "
                             "depend on the RL recipe, so an RL change is measured without training SFT again")
    parser.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of examples/tiny-grpo.yaml, as `rlslurm submit --set` (repeatable)")
    args = parser.parse_args()
    caps = args.caps or cpu_caps()
    missing = [c for c in caps if c not in cpu_caps()]
    if missing:
        print(f"skipped: this CPU lacks {missing} (torch would fall back to another path)", file=sys.stderr)
    rows = []
    for cap in [c for c in caps if c not in missing]:
        for seed in args.seeds:
            rows.append(one(cap, seed, args.run_root, args.reuse_sft, tuple(args.rl_set)))
            print(table(rows[-1:]).splitlines()[1], flush=True)
    print(table(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 0 if rows and min(r["gain"] for r in rows) >= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
