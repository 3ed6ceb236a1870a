"""Small first, then the full job: the demo's GRPO planned from its own small run, then run at that size.

    python bench/bench_from_run.py                         # makes the SFT export first (~1 min), then ~4 min
    python bench/bench_from_run.py --export runs/demo/tiny-sft-.../export/hf --scale 2 --steps 12

1. the small run: examples/tiny-grpo.yaml from the SFT export, `--steps` steps at its 64 prompts per step;
2. `rlslurm plan examples/tiny-grpo.yaml --from-run SMALL --set rl.prompts_per_step=<scale x 64> --json`;
3. the full run: the same job at that many prompts per step, `--steps` steps;
4. each figure of the calibrated plan against what the full run measured (rlslurm/plan_vs_run.py: medians of
   the steady steps), and the uncalibrated plan's beside it. Target (issue 35): step_s within 20 %.

Both runs are real local jobs (`rlslurm submit --backend local --wait`). Seconds move with the machine's load:
the 1-minute load at each run's start is printed; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RLSLURM = str(Path(sys.executable).with_name("rlslurm"))
DEMO = ROOT / "examples" / "tiny-grpo.yaml"


def sh(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def newest(root: Path, prefix: str) -> Path:
    return max(root.glob(prefix + "-*"), key=lambda p: p.stat().st_mtime)


def submit(config: Path, root: Path, *sets: str) -> Path:
    print(f"load {os.getloadavg()[0]:.1f}: {config.name} {' '.join(sets)}", file=sys.stderr, flush=True)
    sh(RLSLURM, "submit", str(config), "--backend", "local", "--run-root", str(root), "--wait",
       *(a for s in sets for a in ("--set", s)))
    return newest(root, config.stem)


def plan(*args: str) -> dict:
    return json.loads(sh(RLSLURM, "plan", str(DEMO), "--json", *args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, default=None, help="An SFT export (made when not given).")
    parser.add_argument("--steps", type=int, default=12, help="Steps of each RL run.")
    parser.add_argument("--scale", type=int, default=2, help="Prompts per step of the full run, x the demo's.")
    parser.add_argument("--run-root", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="Write the rows here too.")
    args = parser.parse_args(argv)
    root = args.run_root or Path(tempfile.mkdtemp(prefix="bench-from-run-"))
    export = args.export
    if export is None:
        export = submit(ROOT / "examples" / "tiny-sft.yaml", root) / "export" / "hf"
    from rlslurm.config import load_config
    from rlslurm.plan_vs_run import compare, measured, planned
    from rlslurm.rundir import RunDir

    prompts = load_config(DEMO).rl.prompts_per_step * args.scale
    # held-out evaluations only at the start and the end: they are no part of a step
    common = (f"train.init_from={export}", f"train.steps={args.steps}", "rl.eval_every=1000")
    small = submit(DEMO, root, *common)
    sets = ("--set", f"rl.prompts_per_step={prompts}", "--set", f"train.init_from={export}")
    calibrated = plan(*sets, "--from-run", str(small))
    uncalibrated = plan(*sets)
    full = submit(DEMO, root, *common, f"rl.prompts_per_step={prompts}")
    kind, found, _ = measured(RunDir(full))
    rows = compare(calibrated, kind, found)
    plain = {r["figure"]: r for r in compare(uncalibrated, kind, found)}
    print(f"small run {small.name} (64 prompts/step) -> full run {full.name} ({prompts} prompts/step)")
    cal = calibrated.get("calibration") or {}
    print(f"calibrated from the small run: {', '.join(cal.get('measured', []))}; still assumed: "
          f"{', '.join(cal.get('assumed', [])) or 'nothing'}")
    print("| figure | full run measured | calibrated plan (ratio) | uncalibrated plan (ratio) |")
    print("|---|---|---|---|")
    for r in rows:
        u = plain[r["figure"]]

        def cell(x):
            return "-" if x["planned"] is None else \
                f"{x['planned']:.4g} ({'-' if x['ratio'] is None else format(x['ratio'], '.2f')})"
        measured_cell = "-" if r["measured"] is None else f"{r['measured']:.4g}"
        print(f"| {r['figure']} | {measured_cell} | {cell(r)} | {cell(u)} |")
    step = next(r for r in rows if r["figure"] == "step_s")
    ok = step["ratio"] is not None and abs(1 / step["ratio"] - 1) <= 0.20
    print(f"\nverdict: step_s planned {step['planned']:.3f} s from the small run, measured {step['measured']:.3f} s "
          f"in the full one: {'within' if ok else 'NOT within'} 20 %")
    if args.json:
        args.json.write_text(json.dumps({"small": str(small), "full": str(full), "rows": rows,
                                         "uncalibrated": list(plain.values()),
                                         "planned_uncalibrated": planned(uncalibrated, kind)}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
