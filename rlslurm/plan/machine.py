"""This machine's measured speed, for the `cpu` profile: matmul FLOP/s per thread, per-op overhead, copy bandwidth.

    speed = cpu_speed()              # measured once (~0.3 s), then read from ~/.cache/rlslurm/cpu-speed.json
    speed.matmul_gflops, speed.op_overhead_us, speed.copy_gb_s

A GPU profile's speed is the vendor's (rlslurm/plan/hardware.py GPU_PROFILES); CPU worker processes standing in
for GPUs have no vendor figure, and a placeholder would be a guess, which the plan must not print. So the plan of
a `cpu` job times fp32 matmuls (one thread, as a trainer rank on the embedded default runs), an elementwise op on
a tiny tensor (what a small model's step is made of: dispatch, not arithmetic) and a large copy, on this machine,
under this torch and its kernel path (ATEN_CPU_CAPABILITY), and caches the result per machine, torch version and
kernel path. `hardware.cpu_matmul_gflops` / `cpu_op_overhead_us` / `cpu_copy_gb_s` override it (tests pin them).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuSpeed:
    """What one trainer thread of this machine does per second."""

    matmul_gflops: float
    """fp32 matmul GFLOP/s of one thread (the median of a 256 x 512 x 512 product)."""
    op_overhead_us: float
    """Microseconds of one small elementwise op: the floor under every op a step runs."""
    copy_gb_s: float
    """GB/s of a 64 MB tensor copy (memory bandwidth as one thread sees it)."""
    source: str
    """Where the figures came from: measured (and when), or the cache file."""


def _key() -> str:
    # torch's version from its package metadata (the same string as torch.__version__): a plan read from the cache
    # loads no torch, so `rlslurm submit --wait`, which waits for the whole job, stays a small process
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    path = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    return f"{cpu}|torch {version('torch')}|{path}"


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlslurm" / "cpu-speed.json"


def measure() -> CpuSpeed:
    """Time this machine now (one thread; ~0.3 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 512), torch.randn(512, 512)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(9):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        gflops = 2 * 256 * 512 * 512 / sorted(times)[len(times) // 2] / 1e9
        x = torch.ones(16)
        t = time.perf_counter()
        for _ in range(2000):
            x = x + 1.0
        op_us = (time.perf_counter() - t) / 2000 * 1e6
        big = torch.ones(16 * 2**20)
        big.clone()
        t = time.perf_counter()
        for _ in range(3):
            big.clone()
        copy = 3 * 2 * big.numel() * 4 / (time.perf_counter() - t) / 1e9  # read + write
    finally:
        torch.set_num_threads(threads)
    return CpuSpeed(round(gflops, 2), round(op_us, 2), round(copy, 2), f"measured {time.strftime('%Y-%m-%d %H:%M')}")


@functools.lru_cache(maxsize=1)
def cpu_speed() -> CpuSpeed:
    """This machine's speed: the cache's figures for this CPU, torch and kernel path, else measured and cached."""
    key, path = _key(), _cache_file()
    try:
        cached = json.loads(path.read_text()).get(key)
        if cached:
            return CpuSpeed(**{**cached, "source": f"{path} ({cached['source']})"})
    except (OSError, ValueError, TypeError):
        pass
    speed = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[key] = asdict(speed)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except (OSError, ValueError):
        pass  # a read-only home: measured again next time
    return speed
