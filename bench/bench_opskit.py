"""What the operations kit costs per training step, and how fast it catches a hang.

    python bench/bench_opskit.py [--steps 200] [--micro 8]

1. Step time of a small CPU training step (an MLP, `--micro` micro-batches per step) without the kit
   and with it (phase guard: a data and a train phase per step, one beat per micro-batch, heartbeats
   written by the flusher thread at most once per diag.heartbeat_interval_s = 1 s, drain gate checked
   at every boundary), in alternating
   blocks in one run so machine noise hits both; prints both medians and the ratio (budget: <= 1 %).
   Also the raw cost of one heartbeat write and one coalesced beat.
2. Hang-detection latency: a real process under the guard stalls in a phase with a 2 s timeout; the
   watchdog polls every 0.25 s; prints seconds from the stall to `hang_detected` and the stack dump time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlslurm.diag.config import DiagConfig
from rlslurm.diag.drain_gate import DrainGate
from rlslurm.diag.guard import PhaseGuard
from rlslurm.diag.heartbeat import HeartbeatWriter
from rlslurm.diag.watchdog import Watchdog
from rlslurm.events import HANG_DETECTED, read_events
from rlslurm.rundir import RunDir


def step_times(run: RunDir, steps: int, micro: int, kit: bool) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(micro, 32, 256)
    guard = PhaseGuard(run, "train", 0, DiagConfig(), DrainGate(run)) if kit else None
    nothing = _Null()
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        with guard.phase("data", step=step) if kit else nothing:
            batch = data + 0.0
        with guard.phase("train", step=step) if kit else nothing:
            for m in range(micro):
                loss = model(batch[m]).pow(2).mean()
                loss.backward()
                if kit:
                    guard.beat()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
    if guard:
        guard.close()
    return times


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def kit_only_us(run: RunDir, micro: int, n: int = 5000) -> float:
    """The kit's own work per step (2 phases, `micro` beats, 4 gate checks) with no model: noise-free."""
    guard = PhaseGuard(run, "train", 1, DiagConfig(), DrainGate(run))
    t0 = time.perf_counter()
    for step in range(n):
        with guard.phase("data", step=step):
            pass
        with guard.phase("train", step=step):
            for _ in range(micro):
                guard.beat()
    per_step = (time.perf_counter() - t0) / n * 1e6
    guard.close()
    return per_step


def raw_costs(run: RunDir, n: int = 2000) -> tuple[float, float]:
    w = HeartbeatWriter(run, "bench", 0, interval_s=1.0, background=False)
    t0 = time.perf_counter()
    for _ in range(n):
        w.update(force=True)
    write_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n * 50):
        w.update()
    beat_us = (time.perf_counter() - t0) / (n * 50) * 1e6
    return write_us, beat_us


STALLER = """
import sys, time
from pathlib import Path
from rlslurm.diag.config import DiagConfig
from rlslurm.diag.guard import PhaseGuard
from rlslurm.rundir import RunDir
guard = PhaseGuard(RunDir(Path(sys.argv[1])), "train", 0, DiagConfig(heartbeat_interval_s=0.1, hang_timeout_s=2))
for step in range(20):
    with guard.phase("train", step=step):
        time.sleep(0.02)
        guard.beat()
print(time.time(), flush=True)
with guard.phase("data", step=20):
    time.sleep(60)
"""


def hang_latency(root: Path) -> tuple[float, float]:
    run = RunDir(root / "hang").create()
    p = subprocess.Popen([sys.executable, "-c", STALLER, str(run.path)], stdout=subprocess.PIPE, text=True)
    try:
        stalled_at = float(p.stdout.readline())
        dog = Watchdog(run, DiagConfig(hang_timeout_s=2, watch_interval_s=0.25, hang_policy="dump"))
        while not dog.reports and time.time() - stalled_at < 30:
            t0 = time.time()
            dog.poll()
            dump_s = time.time() - t0
            time.sleep(0.25)
        (event,) = read_events(run, HANG_DETECTED)
        return event["t"] - stalled_at, dump_s
    finally:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "run").create()
        step_times(run, 20, args.micro, kit=True)  # warm-up
        base, kit = [], []
        for _ in range(args.blocks):
            base += step_times(run, args.steps // args.blocks, args.micro, kit=False)
            kit += step_times(run, args.steps // args.blocks, args.micro, kit=True)
        b, k = statistics.median(base), statistics.median(kit)
        write_us, beat_us = raw_costs(run)
        kit_us = kit_only_us(run, args.micro)
        latency, dump_s = hang_latency(Path(tmp))
    print(f"step time (median of {len(base)}, {args.micro} micro-batches): without kit {b * 1e3:.3f} ms | "
          f"with kit {k * 1e3:.3f} ms | ratio {k / b:.4f} (overhead {100 * (k / b - 1):+.2f} %, budget 1 %)")
    print(f"kit alone: {kit_us:.1f} us per step = {100 * kit_us / (b * 1e6):.2f} % of the {b * 1e3:.2f} ms step "
          f"(the side-by-side ratio above also carries the noise of a shared machine)")
    print(f"heartbeat write {write_us:.1f} us (done by the flusher thread, at most 1 per s); "
          f"beat in memory {beat_us:.2f} us")
    print(f"hang detection: {latency:.2f} s from stall to hang_detected (timeout 2 s, watch interval 0.25 s); "
          f"dump + report {dump_s:.2f} s")


if __name__ == "__main__":
    main()
