"""What the operations kit costs per training step, and how fast it catches a hang.

    python bench/bench_opskit.py [--steps 200] [--micro 8]

1. Step time of a small CPU training step (an MLP, `--micro` micro-batches per step) without the kit
   and with it (phase guard: a data and a train phase per step, one beat per micro-batch, heartbeats
   written by the flusher thread at most once per diag.heartbeat_interval_s = 1 s, drain gate checked
   at every boundary, torch's flight recorder on and served as on every trainer rank), step by step in
   alternating pairs (one step of each side, AB then BA): the ratio is the median of the pairs' ratios, so
   the drift of a shared machine's load falls on both steps of a pair alike, plus the flusher's background
   work (one heartbeat write per interval, as a share of it). Budget: <= 1 %. Pooled medians of long blocks
   of each side read 1.03-1.09 at load 4-8 here while the kit's own work was 0.1 % of a step: the load's drift
   between blocks, not the kit. Also the kit's own work per step with no model (a tight loop), the same calls
   timed in place inside real steps (10x more: cold caches after the step's torch work; what the ratio sees), and
   the raw cost of one heartbeat write and one beat.
2. Hang-detection latency: a real process under the guard stalls in a phase with a 2 s timeout; the
   watchdog polls every 0.25 s; prints seconds from the stall to `hang_detected` and the stack dump time.
"""

from __future__ import annotations

import argparse
import os
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


class Work:
    """The training step both sides run: one model, optimizer and batch for the whole bench."""

    def __init__(self, micro: int):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.data = torch.randn(micro, 32, 256)


def side_by_side(run: RunDir, steps: int, micro: int, write_us: float, interval_s: float = 1.0) -> dict:
    """`steps` pairs of steps, one without the kit's phases and beats and one with them, alternating (AB, then BA),
    so a shared machine's drift falls on both steps of a pair alike; the ratio is the median over pairs, plus the
    kit's background work (one heartbeat write of `write_us` per `interval_s`, the flusher's) as a share of a second.
    The guard (its flusher thread, the flight recorder's server) lives through both sides' steps."""
    work = Work(micro)
    guard = PhaseGuard(run, "train", 0, DiagConfig(heartbeat_interval_s=interval_s), DrainGate(run))
    nothing = _Null()
    base, kit, pairs = [], [], []
    try:
        for i in range(steps + 10):  # the first 10 pairs warm up
            got = {}
            for side in ((False, True) if i % 2 == 0 else (True, False)):
                got[side] = one_step(work, guard if side else None, nothing, i, micro)
            if i >= 10:
                base.append(got[False])
                kit.append(got[True])
                pairs.append(got[True] / got[False])
    finally:
        guard.close()
    background = write_us / 1e6 / interval_s
    return {"steps": len(base), "base_ms": 1e3 * statistics.median(base), "kit_ms": 1e3 * statistics.median(kit),
            "foreground": statistics.median(pairs), "background": background,
            "ratio": statistics.median(pairs) + background}


def one_step(work: Work, guard: PhaseGuard | None, nothing, step: int, micro: int) -> float:
    """One training step, its phases and beats through `guard` (None: none); its seconds."""
    t0 = time.perf_counter()
    with guard.phase("data", step=step) if guard else nothing:
        batch = work.data + 0.0
    with guard.phase("train", step=step) if guard else nothing:
        for m in range(micro):
            work.model(batch[m]).pow(2).mean().backward()
            if guard:
                guard.beat()
        work.opt.step()
        work.opt.zero_grad()
    return time.perf_counter() - t0


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
    """One heartbeat write, and one beat (the flusher's counter), in a tight loop: microseconds."""
    w = HeartbeatWriter(run, "bench", 0, interval_s=1.0, background=False)
    t0 = time.perf_counter()
    for _ in range(n):
        w.update(force=True)
    write_us = (time.perf_counter() - t0) / n * 1e6
    counted = HeartbeatWriter(run, "bench", 1, interval_s=1.0)
    beat = counted.beat
    t0 = time.perf_counter()
    for _ in range(n * 50):
        beat()
    beat_us = (time.perf_counter() - t0) / (n * 50) * 1e6
    counted.close()
    return write_us, beat_us


def in_place_us(run: RunDir, micro: int, steps: int = 200) -> tuple[float, float]:
    """The kit's calls timed inside real steps, less the timer's own cost timed in the same places: microseconds
    per step, and per call. Far above `kit_only_us`: each call finds the caches the step's torch work left."""
    work = Work(micro)
    guard = PhaseGuard(run, "train", 2, DiagConfig(), DrainGate(run))
    clock = time.perf_counter
    kit = timer = 0.0
    for step in range(steps + 10):
        spent = 0.0
        for timing_only in (True, False):  # a step of empty timings, then one of timed kit calls
            t = clock()
            phase = None if timing_only else guard.phase("data", step=step)
            phase and phase.__enter__()
            spent += clock() - t
            batch = work.data + 0.0
            t = clock()
            if phase:
                phase.__exit__(None, None, None)
                phase = guard.phase("train", step=step)
                phase.__enter__()
            spent += clock() - t
            for m in range(micro):
                work.model(batch[m]).pow(2).mean().backward()
                t = clock()
                phase and guard.beat()
                spent += clock() - t
            work.opt.step()
            work.opt.zero_grad()
            t = clock()
            phase and phase.__exit__(None, None, None)
            spent += clock() - t
            if step >= 10:
                if timing_only:
                    timer += spent
                else:
                    kit += spent
            spent = 0.0
    guard.close()
    per_step = (kit - timer) / steps * 1e6
    return per_step, per_step / (micro + 4)


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
    ap.add_argument("--steps", type=int, default=400, help="pairs of steps (one of each side)")
    ap.add_argument("--micro", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "run").create()
        write_us, beat_us = raw_costs(run)
        r = side_by_side(run, args.steps, args.micro, write_us)
        b, k, ratio = r["base_ms"] / 1e3, r["kit_ms"] / 1e3, r["ratio"]
        kit_us = kit_only_us(run, args.micro)
        place_us, call_us = in_place_us(run, args.micro)
        latency, dump_s = hang_latency(Path(tmp))
    print(f"step time ({r['steps']} alternating pairs, {args.micro} micro-batches): without kit {b * 1e3:.3f} ms | "
          f"with kit {k * 1e3:.3f} ms (medians) | ratio {ratio:.4f} = median of pair ratios {r['foreground']:.4f} + "
          f"flusher {r['background']:.4f} (overhead {100 * (ratio - 1):+.2f} %, budget 1 %; load "
          f"{os.getloadavg()[0]:.2f})")
    print(f"kit alone: {kit_us:.1f} us per step = {100 * kit_us / (b * 1e6):.2f} % of the {b * 1e3:.2f} ms step "
          f"(the side-by-side ratio above also carries the noise of a shared machine)")
    print(f"kit in place: {place_us:.1f} us per step = {100 * place_us / (b * 1e6):.2f} %, {call_us:.1f} us per call "
          f"(timed inside the steps, the timer's own cost taken off: the step's torch work leaves each call cold "
          f"caches)")
    print(f"heartbeat write {write_us:.1f} us (done by the flusher thread, at most 1 per s); "
          f"beat {beat_us:.3f} us (a step of the flusher's counter)")
    print(f"hang detection: {latency:.2f} s from stall to hang_detected (timeout 2 s, watch interval 0.25 s); "
          f"dump + report {dump_s:.2f} s")


if __name__ == "__main__":
    main()
