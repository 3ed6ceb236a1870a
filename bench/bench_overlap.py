"""Overlap bench: the RL step running ahead of the trainer (rl.max_staleness 1) vs synchronous (0), in one run.

    python bench/bench_overlap.py            # ~3 min on 2 cores: SFT, then 3 x (synchronous, overlapped) RL runs
    python bench/bench_overlap.py --quick    # ~2 min: a shorter SFT, 2 pairs of short RL runs

Every RL run is examples/tiny-grpo.yaml (the embedded default: 2 trainer ranks over gloo, one engine
process, the reward service) from one SFT export of examples/tiny-sft.yaml, so groups have signal and the
train phase does real work. The runs alternate in pairs (synchronous, overlapped) and each ratio is taken
within its pair, so a load change on a shared machine shifts both sides; the table shows the pair with
the median ratio and lists every pair's. Per run: medians over its steps but the first (nothing to run
ahead of yet) and the last (it holds the final evaluation).

Goal: overlapped step <= 1.1 x max(rollout, reward, train) + sync, with each phase's median as the
synchronous runs measure it (each phase alone on the machine). On 2 cores that goal is out of reach by
construction: the two trainer ranks take both cores while they train, so the engine generating the next
step's responses meanwhile only gets CPU the ranks leave; overlap pays where the rollout has hardware of
its own (a GPU engine, a rollout node), and the ratio here is an honest lower bound of the gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _submit(example: str, run_root: Path, overrides: list[str]) -> Path:
    from rlslurm import launch
    from rlslurm.config import load_config

    path = ROOT / "examples" / example
    job = load_config(path, overrides)
    sub = launch.submit(job, config_text=path.read_text(), backend="local", run_root=run_root)
    codes = [int(c) for c in launch.wait(sub, timeout_s=900, poll_s=0.5)]
    if codes != [0] * len(codes):
        raise RuntimeError(f"{example} {overrides} ended {codes}; see {sub.run_dir}")
    return sub.run_dir


def _steps(run_dir: Path) -> list[dict]:
    from rlslurm.rundir import read_jsonl

    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "policy_version" in r]


def _medians(rows: list[dict]) -> dict[str, float]:
    inner = rows[1:-1]
    keys = ("step_s", "rollout_s", "reward_s", "train_s", "sync_s", "sync_wait_rollout_s")
    return {k: statistics.median(r.get(k, 0.0) for r in inner) for k in keys}


def run(quick: bool) -> dict:
    sft_steps, rl_steps, pairs = (400, 12, 2) if quick else (850, 25, 3)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        sft = _submit("tiny-sft.yaml", root / "sft", [f"train.steps={sft_steps}", "task.eval_size=100"])
        sft_s = time.monotonic() - started
        # eval_size only shortens the evaluations at the start and the end: the train split is the same
        common = [f"train.init_from={sft / 'export' / 'hf'}", f"train.steps={rl_steps}", "rl.eval_every=1000",
                  "checkpoint.interval_steps=1000", "task.eval_size=100"]
        results = []
        for _ in range(pairs):
            pair = {}
            for k in (0, 1):
                run_dir = _submit("tiny-grpo.yaml", root / f"rl-k{k}", common + [f"rl.max_staleness={k}"])
                pair["sync" if k == 0 else "overlapped"] = _medians(_steps(run_dir))
            sync = pair["sync"]
            pair["bound_s"] = 1.1 * max(sync["rollout_s"], sync["reward_s"], sync["train_s"]) + sync["sync_s"]
            pair["goal_ratio"] = pair["overlapped"]["step_s"] / pair["bound_s"]
            pair["speedup_ratio"] = pair["overlapped"]["step_s"] / sync["step_s"]
            results.append(pair)
    return {"cores": len(os.sched_getaffinity(0)), "load_before": load_before, "load_after": os.getloadavg()[0],
            "sft_steps": sft_steps, "sft_s": sft_s, "rl_steps": rl_steps, "pairs": results}


def median_pair(pairs: list[dict], key: str) -> dict:
    """The pair whose `key` ratio is the median (the upper one of two): both of its sides saw the same load."""
    return sorted(pairs, key=lambda p: p[key])[len(pairs) // 2]


def row(measure: str, values: str, ratio: float, goal: str = "-", ok: bool | None = None) -> dict:
    return {"measure": measure, "values": values, "ratio": ratio, "goal": goal, "ok": ok}


def rows(r: dict) -> list[dict]:
    """Table rows (measure, values, ratio, goal, ok) for run_all and for main."""
    pairs = r["pairs"]
    g = median_pair(pairs, "goal_ratio")
    gs, go = g["sync"], g["overlapped"]
    v = median_pair(pairs, "speedup_ratio")
    each = ", ".join(f"{p['speedup_ratio']:.2f}" for p in pairs)
    for p in pairs:
        p["train_ratio"] = p["overlapped"]["train_s"] / p["sync"]["train_s"]
    t = median_pair(pairs, "train_ratio")
    return [
        row("overlap: step / (1.1 max phase + sync)",
            f"{1e3 * go['step_s']:.0f} ms / (1.1 x max({1e3 * gs['rollout_s']:.0f}, {1e3 * gs['reward_s']:.0f}, "
            f"{1e3 * gs['train_s']:.0f}) + {1e3 * gs['sync_s']:.0f} ms) ({r['cores']} cores)", g["goal_ratio"],
            "<= 1.0", g["goal_ratio"] <= 1.0),
        row("overlap: overlapped / synchronous step",
            f"{1e3 * v['overlapped']['step_s']:.0f} ms / {1e3 * v['sync']['step_s']:.0f} ms (median of "
            f"{len(pairs)} pairs: {each}; load {r['load_before']:.1f} -> {r['load_after']:.1f})", v["speedup_ratio"]),
        # What 2 cores can do at best: the step's CPU work (the engine's 1 thread x rollout, the 2 trainer
        # ranks x train, the reward) spread over every core, then the sync (the engines are drained).
        row("overlap: step / CPU floor",
            f"{1e3 * go['step_s']:.0f} ms / (({1e3 * gs['rollout_s']:.0f} + 2 x {1e3 * gs['train_s']:.0f} + "
            f"{1e3 * gs['reward_s']:.0f}) / {r['cores']} + {1e3 * gs['sync_s']:.0f} ms)",
            go["step_s"] / ((gs["rollout_s"] + 2 * gs["train_s"] + gs["reward_s"]) / r["cores"] + gs["sync_s"])),
        row("overlap: train phase overlapped / alone",
            f"{1e3 * t['overlapped']['train_s']:.0f} ms / {1e3 * t['sync']['train_s']:.0f} ms (the next rollout "
            f"beside it: {1e3 * t['overlapped']['rollout_s']:.0f} ms)", t["train_ratio"]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter SFT and one pair of short RL runs")
    ap.add_argument("--json-out", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    result = run(args.quick)
    for r in rows(result):
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['measure']:<42} {r['values']:<70} {ratio:>7}  {r['goal']}")
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
