"""Two of the per-step overheads issue 36 cut, each measured on its own, before and after side by side in one run.

    python bench/bench_overheads.py --export runs/tiny-sft-.../export/hf [--repeats 30]

1. The behaviour forward: one trainer rank's update of its share of the demo's step (256 samples, micro-batches of
   64, one thread) with the separate no-grad forward for the behaviour log-probs (before) and with them taken from
   the training forward (after: rlslurm/rl/config.py behaviour_forward), alternating; median seconds of each.
2. The engine's threads: the demo's rollout (64 prompts x 8 samples, 8 tokens) on an hf engine server of one
   thread (before), of two with OpenMP's threads spinning (OMP_WAIT_POLICY=ACTIVE) and of two passive (after:
   what rank 0 now spawns beside the trainer), the servers asked in turn; median seconds of each.

The other cuts are measured by bench/bench_vs_trl.py on the whole job: the reward (`--rl-set reward.service=local
--rl-set reward.batch_size=64` is the old demo), start-up and memory. The load is printed with every figure.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"


def behaviour_forward(export: Path, repeats: int) -> dict:
    import torch

    import rlslurm.rl.policy as policy_module
    from rlslurm.config import load_config
    from rlslurm.diag.guard import PhaseGuard
    from rlslurm.dist import Topology
    from rlslurm.rl.experience import Sample
    from rlslurm.rundir import RunDir

    torch.set_num_threads(1)
    job = load_config(EXAMPLE, [f"train.init_from={export}"])
    topo = Topology(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0)
    rng = random.Random(0)
    samples = []
    for _ in range(256):  # prompts of the task's length (BOS + "ab+cd="), answers of 2-4 digits and EOS
        prompt = [1] + [rng.randrange(4, 19) for _ in range(6)]
        response = [rng.randrange(4, 19) for _ in range(rng.randrange(2, 5))] + [2]
        samples.append(Sample(prompt, response, 0.0, rng.uniform(-1, 1), 0, [-0.5] * len(response)))
    fused = policy_module.behaviour_forward
    times: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "run").create()
        guard = PhaseGuard(run, "train", 0, job.diag, faulthandler_fallback=False, background=False)
        policy = policy_module.Policy(job, topo, export)
        try:
            for i in range(repeats):
                for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
                    policy_module.behaviour_forward = (lambda mini_batches: True) if side == "before" else fused
                    t = time.perf_counter()
                    policy.update(samples, guard, step_total=len(samples))
                    times[side].append(time.perf_counter() - t)
        finally:
            policy_module.behaviour_forward = fused
            guard.close()
    return {side: statistics.median(ts) for side, ts in times.items()}


def engine_threads(export: Path, repeats: int) -> dict:
    from rlslurm.config import load_config
    from rlslurm.data.splits import load_splits
    from rlslurm.dist import free_port
    from rlslurm.rl.draw import PromptStream
    from rlslurm.rollout.client import spawn_engine

    job = load_config(EXAMPLE, [f"train.init_from={export}"])
    train, _ = load_splits(job)
    stream = PromptStream(train, per_step=job.rl.prompts_per_step, seed=0, max_bad_share=0.01)
    stream.resume(0, None)
    prompts = [[s.prompt for s in stream.draw(step).samples] for step in range(8)]
    sides = {"1 thread": (1, "PASSIVE"), "2 threads spinning": (2, "ACTIVE"), "2 threads passive": (2, "PASSIVE")}
    times: dict[str, list[float]] = {side: [] for side in sides}
    limits = ["--max-prompts", "1000", "--max-n", "8", "--max-tokens", "8"]
    with tempfile.TemporaryDirectory() as tmp:
        servers = {side: spawn_engine(export, port=free_port(), log_path=Path(tmp) / f"{n}-{policy}.log",
                                      extra_args=["--threads", str(n), *limits], env={"OMP_WAIT_POLICY": policy})
                   for side, (n, policy) in sides.items()}
        try:
            for i in range(repeats):
                order = list(servers) if i % 2 == 0 else list(reversed(servers))
                for side in order:
                    t = time.perf_counter()
                    servers[side].client.completions(prompts[i % len(prompts)], n=job.rl.samples_per_prompt,
                                                     max_tokens=job.rollout.max_new_tokens, temperature=1.0, seed=i)
                    times[side].append(time.perf_counter() - t)
        finally:
            for server in servers.values():
                server.stop()
    return {side: statistics.median(ts) for side, ts in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True, help="an SFT export (<tiny-sft run>/export/hf)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    export = args.export.resolve()
    load = os.getloadavg()[0]
    b = behaviour_forward(export, args.repeats)
    print(f"behaviour forward: update of 256 samples {b['before'] * 1e3:.1f} ms with it, {b['after'] * 1e3:.1f} ms "
          f"without (x{b['after'] / b['before']:.2f}); load {load:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    load = os.getloadavg()[0]
    e = engine_threads(export, args.repeats)
    print("engine threads: rollout of 64 prompts x 8 " + ", ".join(f"{side} {s * 1e3:.0f} ms" for side, s in e.items())
          + f"; load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
