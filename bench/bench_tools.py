"""The tool task's learning result: SFT on tool-use traces, then GRPO with the calculator, against the same SFT
model's GRPO without it, across CPU kernel paths and seeds.

    python -m rlslurm.tasks.calculator --out examples/data/calc          # once: the task's files
    python bench/bench_tools.py                                          # every kernel path this CPU has x seed 0
    python bench/bench_tools.py --caps default avx2 --seeds 0 1 --json-out /tmp/tools.json

One row per (ATEN_CPU_CAPABILITY, train.seed): examples/tool-sft.yaml, then examples/tool-grpo.yaml from its export
twice, through `rlslurm submit --backend local --wait`: with the tool (rollout.max_turns 3, tools [calculator]),
and without it (rollout.max_turns 1, no tools: the model's calls are never answered, it must answer in its
head). Each GRPO run's first held-out evaluation (step 0) is the SFT start, its last the result.

Printed: SFT held-out with the tool (the start), GRPO with the tool, the gain; the same SFT model's start and
result without the tool; wall seconds per stage; the machine's 1-min load at the row's start. Exits 1 unless
every row's gain is >= 0.10.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_learning import _metrics, _submit, cpu_caps  # noqa: E402  (one way to submit and read runs)

ROOT = Path(__file__).resolve().parents[1]
NO_TOOL = ("rollout.max_turns=1", "rollout.tools=[]")


def _evals(run: Path) -> list[float]:
    """Held-out accuracy of a GRPO run's evaluations, in order: the step-0 one (events.jsonl) first."""
    from rlslurm import events
    from rlslurm.rundir import RunDir

    first = [e["held_out_accuracy"] for e in events.read_events(RunDir(run), events.EVAL)][:1]
    return first + [r["held_out_accuracy"] for r in _metrics(run) if "held_out_accuracy" in r]


def one(cap: str, seed: int, root: Path, rl_sets: tuple[str, ...] = ()) -> dict:
    load = os.getloadavg()[0]
    where = root / f"{cap}-{seed}"
    sft, sft_s = _submit("tool-sft.yaml", where, cap, [f"train.seed={seed}"])
    init = [f"train.seed={seed}", f"train.init_from={sft / 'export' / 'hf'}", *rl_sets]
    tool, tool_s = _submit("tool-grpo.yaml", where, cap, init)
    bare, bare_s = _submit("tool-grpo.yaml", where, cap, [*init, *NO_TOOL])
    with_tool, without = _evals(tool), _evals(bare)
    rows = _metrics(tool)
    return {"cap": cap, "seed": seed, "sft": with_tool[0], "rl": with_tool[-1], "gain": with_tool[-1] - with_tool[0],
            "bare_sft": without[0], "bare_rl": without[-1], "turns": rows[-1]["episode_turns_mean"],
            "tool_errors": sum(r["tool_errors"] for r in rows), "sft_s": sft_s, "rl_s": tool_s, "bare_s": bare_s,
            "load": load, "sft_run": str(sft), "rl_run": str(tool), "bare_run": str(bare)}


COLUMNS = (("cap", "{:<8}"), ("seed", "{:>4}"), ("sft", "{:>6.3f}"), ("rl", "{:>6.3f}"), ("gain", "{:>+7.3f}"),
           ("bare_sft", "{:>8.3f}"), ("bare_rl", "{:>7.3f}"), ("turns", "{:>5.2f}"), ("tool_errors", "{:>11d}"),
           ("sft_s", "{:>6.0f}"), ("rl_s", "{:>5.0f}"), ("bare_s", "{:>6.0f}"), ("load", "{:>5.1f}"))


def table(rows: list[dict]) -> str:
    lines = ["  ".join(f"{name:>{len(fmt.format(0) if name != 'cap' else 'default ')}}" for name, fmt in COLUMNS)]
    lines += ["  ".join(fmt.format(r[name]) for name, fmt in COLUMNS) for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", nargs="+", default=None, help="kernel paths (default: every one this CPU has)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench-tools")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of examples/tool-grpo.yaml, as `rlslurm submit --set` (repeatable)")
    args = parser.parse_args()
    if not (ROOT / "examples" / "data" / "calc" / "sft.jsonl").is_file():
        print("no examples/data/calc: run `python -m rlslurm.tasks.calculator --out examples/data/calc` first",
              file=sys.stderr)
        return 2
    caps = [c for c in (args.caps or cpu_caps()) if c in cpu_caps()]
    rows = []
    for cap in caps:
        for seed in args.seeds:
            rows.append(one(cap, seed, args.run_root, tuple(args.rl_set)))
            print(table(rows[-1:]).splitlines()[1], flush=True)
    print(table(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 0 if rows and min(r["gain"] for r in rows) >= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
