"""All of rlslurm's benchmarks in one run, side by side: one table of ratios and bench/results.json.

    python bench/run_all.py            # full sizes (~8 min on 2 cores)
    python bench/run_all.py --quick    # smaller sizes (~5 min on 2 cores)
    python bench/run_all.py --only sync --json-out /tmp/r.json

Benches (each file also runs alone):
    reward  bench/bench_reward.py   judge throughput through the reward service vs. the ideal of its
                                    concurrency; sandbox executions vs. a bare subprocess
    opskit  bench/bench_opskit.py   step time with the operations kit vs. without; hang-detection latency
    sync    bench/bench_sync.py     each weight-sync method vs. its raw transport; protocol overhead
    overlap bench/bench_overlap.py  RL step time running ahead of the trainer (rl.max_staleness 1) vs.
                                    synchronous, against max(rollout, reward, train) + sync
    requeue bench/bench_requeue.py  requeue -> training again on the real local Slurm (needs root and
                                    sbatch/install.sh), by scontrol requeue and by rlslurm drain

A bench module that defines `run(quick) -> dict` and `rows(result) -> list[dict]` is called through
them; for the others an adapter below calls the functions the file exposes. Every ratio is measured
within this one run (both sides of a ratio on the same machine, minutes apart at most), so machine
load shifts both. A bench that fails is reported as such and the others still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results.json"

# What each measure means, printed under the table (keyed by the start of the measure's name).
MEANINGS = {
    "judge: measured / ideal": "wall time to score all responses through the supervised reward service / "
                               "(responses / concurrency x judge latency); 1.0 = concurrency fully used",
    "judge: measured / serial": "the same wall time / one-at-a-time scoring (the lecture's 1024 s case)",
    "sandbox vs bare": "executions per second per core in the sandbox / as a bare subprocess; 1.0 = free",
    "opskit: step time": "median CPU training-step time with phase guard, heartbeats and drain gate / without",
    "opskit: hang detection": "seconds from a stalled phase to the hang_detected event / the phase timeout",
    "overlap": "step: the overlapped RL step's median / (1.1 x the largest of the synchronous run's rollout, "
               "reward, train medians + its sync); on 2 cores the trainer ranks hold both cores while they train, "
               "so the rollout beside them gets little: the ratio is a lower bound of the overlap's gain; CPU floor: "
               "(rollout + 2 ranks x train + reward core-seconds) / cores + sync, the best 2 cores allow",
    "requeue": "seconds from the trigger to the first training step after the restart / SLURM's part of them "
               "(trigger -> the restart's processes start; on the local cluster at least cred_expire 5 s + "
               "KillWait 5 s); the rest is rlslurm's: imports, rendezvous, checkpoint load",
    "sync": "UPDATE vs raw: raw transport seconds / protocol UPDATE seconds for the same bytes (1.0 = no loss); "
            "overhead: (DRAIN + VERIFY) / UPDATE, checksums are inside UPDATE (computed as bytes move); "
            "whole-sync overhead: (whole sync - UPDATE) / UPDATE",
}


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"bench_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(measure: str, values: str, ratio: float | None, goal: str = "-", ok: bool | None = None) -> dict:
    return {"measure": measure, "values": values, "ratio": ratio, "goal": goal, "ok": ok}


# -- adapters for benches that are scripts with functions ------------------------------------------

def reward_run(bench, quick: bool) -> dict:
    responses, concurrency, latency_s, executions = (256, 64, 1.0, 40) if quick else (512, 64, 2.0, 200)
    cores = len(os.sched_getaffinity(0))
    return {"responses": responses, "concurrency": concurrency, "latency_s": latency_s,
            "judge": bench.bench_judge(responses, concurrency, latency_s),
            "sandbox": bench.bench_sandbox(executions, cores)}


def reward_rows(r: dict) -> list[dict]:
    j, s = r["judge"], r["sandbox"]
    ideal = j["wall_s"] / j["ideal_s"]
    return [
        row("judge: measured / ideal", f"{j['wall_s']:.2f} s / {j['ideal_s']:.2f} s "
            f"({r['responses']} x {r['latency_s']:g} s / {r['concurrency']})", ideal, "<= 1.1", ideal <= 1.1),
        row("judge: measured / serial", f"{j['wall_s']:.2f} s / {j['serial_s']:.0f} s", j["wall_s"] / j["serial_s"]),
        row("judge: degraded responses", f"{j['degraded']} of {r['responses']}", j["degraded"] / r["responses"],
            "0", j["degraded"] == 0),
        row(f"sandbox vs bare: exec/s/core ({s['mode']})",
            f"{s['sandbox_per_s_core']:.1f} vs {s['bare_per_s_core']:.1f} "
            f"(+{s['sandbox_ms'] - s['bare_ms']:.1f} core-ms each)", s["sandbox_per_s_core"] / s["bare_per_s_core"]),
    ]


def opskit_run(bench, quick: bool) -> dict:
    """What bench_opskit.main measures: alternating blocks without / with the kit, then a real hang."""
    import torch

    from rlslurm.rundir import RunDir

    steps, micro = (200, 8) if quick else (400, 8)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-opskit-") as tmp:
        run = RunDir(Path(tmp) / "run").create()
        write_us, _ = bench.raw_costs(run)
        result = bench.side_by_side(run, steps, micro, write_us)
        latency_s, dump_s = bench.hang_latency(Path(tmp))
    return {**result, "hang_latency_s": latency_s, "hang_timeout_s": 2.0, "dump_s": dump_s}


def opskit_rows(r: dict) -> list[dict]:
    ratio = r["ratio"]
    return [
        row("opskit: step time with kit / without", f"{r['kit_ms']:.3f} ms / {r['base_ms']:.3f} ms "
            f"(medians; ratio: median of {r['steps']} alternating pairs + flusher {r['background']:.4f})", ratio,
            "<= 1.01", ratio <= 1.01),
        row("opskit: hang detection latency / timeout", f"{r['hang_latency_s']:.2f} s / {r['hang_timeout_s']:.0f} s "
            f"(dump {r['dump_s']:.2f} s)", r["hang_latency_s"] / r["hang_timeout_s"]),
    ]


ADAPTERS = {"reward": (reward_run, reward_rows), "opskit": (opskit_run, opskit_rows)}
BENCHES = ("reward", "opskit", "sync", "overlap", "requeue")


def run_bench(name: str, quick: bool) -> dict:
    started = time.monotonic()
    try:
        bench = load_bench(name)
        if hasattr(bench, "run") and hasattr(bench, "rows"):
            result = bench.run(quick)
            rows = bench.rows(result)
        else:
            run, to_rows = ADAPTERS[name]
            result = run(bench, quick)
            rows = to_rows(result)
        return {"name": name, "ok": True, "seconds": time.monotonic() - started, "result": result, "rows": rows}
    except Exception as e:  # one broken bench must not hide the others' numbers
        traceback.print_exc()
        return {"name": name, "ok": False, "seconds": time.monotonic() - started,
                "error": f"{type(e).__name__}: {e}", "rows": []}


def render(benches: list[dict]) -> str:
    lines = []
    table = [(b["name"], r) for b in benches for r in b["rows"]]
    w_measure = max([len(r["measure"]) for _, r in table] + [7])
    w_values = max([len(r["values"]) for _, r in table] + [6])
    lines.append(f"{'bench':<7} {'measure':<{w_measure}}  {'values':<{w_values}}  {'ratio':>7}  {'goal':<8} verdict")
    for name, r in table:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        verdict = {True: "ok", False: "MISSED", None: ""}[r["ok"]]
        lines.append(f"{name:<7} {r['measure']:<{w_measure}}  {r['values']:<{w_values}}  {ratio:>7}  "
                     f"{r['goal']:<8} {verdict}")
    for b in benches:
        status = f"{b['seconds']:.0f} s" if b["ok"] else f"FAILED after {b['seconds']:.0f} s: {b['error']}"
        lines.append(f"  {b['name']}: {status}")
    lines.append("what the numbers mean:")
    lines.extend(f"  {k}: {v}" for k, v in MEANINGS.items())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes: the whole run in ~30 s on 2 cores")
    ap.add_argument("--only", choices=BENCHES, action="append", help="run only these benches (repeatable)")
    ap.add_argument("--json-out", type=Path, default=RESULTS, help=f"where to write the results (default {RESULTS})")
    args = ap.parse_args(argv)
    started = time.time()
    benches = []
    for name in args.only or BENCHES:
        print(f"== {name}", flush=True)
        benches.append(run_bench(name, args.quick))
    print()
    print(render(benches))
    payload = {"started": started, "seconds": time.time() - started, "quick": args.quick,
               "host": {"node": platform.node(), "cpus": len(os.sched_getaffinity(0)),
                        "python": platform.python_version()},
               "benches": benches}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {args.json_out}")
    return 0 if all(b["ok"] for b in benches) else 1


if __name__ == "__main__":
    sys.exit(main())
