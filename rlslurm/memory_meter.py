"""Measured memory of one trainer rank, per phase: the peak of live tensor bytes and of the process's RSS.

    meter = MemoryMeter(device, every_steps=job.diag.memory_every_steps, owned=policy.owned_tensors)
    with meter.tracking():                  # once, around what allocates outside any phase (DDP's buckets)
        ddp = DistributedDataParallel(model)
    if meter.start_step(step):              # a metered step (every step on a GPU; sampled on the CPU)
        with meter.measure("forward_backward"): ...
        with meter.measure("optimizer"): ...
    meter.peaks()                           # {"forward_backward": {"tensor_gb": .., "rss_gb": ..}, ...}

What the plan's trainer peak predicts is what a GPU's caching allocator holds at its worst moment: weights,
gradients, optimizer state, activations and the temporaries of the backward pass. On a GPU that is
`torch.cuda.max_memory_allocated` (and `max_memory_reserved` beside it), read every step at no cost. On the
CPU torch keeps no such counter, so `LiveTensors` counts it: a TorchDispatchMode that sees every op's output
storage (a weakref tells it when the storage is freed), seeded with what the rank already holds (`owned`:
parameters, gradients, optimizer state). It costs Python work per op (~13 us: about half of the tiny model's
train phase), so on the CPU it runs on step 1 and every `every_steps`-th step after; the other steps record
nulls. The RSS beside it is the kernel's high-water mark (VmHWM), reset at each phase's start
(/proc/self/clear_refs), so it is the phase's own peak, not the process's since it started.
"""

from __future__ import annotations

import contextlib
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward_backward", "optimizer", "sync")
"""The phases a trainer rank meters: the policy update's forward and backward passes (behaviour log-probs
included), its optimizer steps (clip + step), and rank 0's weight sync."""


class LiveTensors(TorchDispatchMode):
    """Bytes of live CPU tensor storage and their peak, counted from the outputs of every op run under the
    mode plus the tensors `seed` names; a storage counts once (views share it) until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def seed(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_meta:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._refs:
            return
        size = storage.nbytes()
        # The callback fires when the C++ storage dies: torch keeps one Python object per live storage.
        self._refs[key] = (weakref.ref(storage, lambda _ref, key=key: self._free(key)), size)
        self.live += size
        if self.live > self.peak:
            self.peak = self.live

    def _free(self, key: int) -> None:
        entry = self._refs.pop(key, None)
        if entry is not None:
            self.live -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._track(t)
        return out


def rss_peak_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM) since it started or the last reset."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def reset_rss_peak() -> None:
    """Set VmHWM to the current RSS (Linux: writing 5 to clear_refs), so the next read is a phase's own peak."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


@dataclass
class MemoryMeter:
    """Per-phase memory peaks of one rank (see the module docstring). Lifecycle: `tracking()` around
    allocations made before the first step; `start_step(step)` at each step says whether it is metered;
    `measure(name)` around each metered phase; `peaks()` reads the step's figures."""

    device: torch.device
    every_steps: int = 25
    """On the CPU: meter step 1 and every every_steps-th (0: never); a GPU's counters are read every step."""
    owned: Callable[[], Iterable[torch.Tensor]] = lambda: ()
    """What the rank holds between steps (parameters, gradients, optimizer state), seeded before a phase."""
    metered: bool = False
    metered_s: float = 0.0
    """Seconds spent in metered phases over the run (their cost is what sampling amortises)."""
    _live: LiveTensors | None = None
    _peaks: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def __post_init__(self):
        if not self.on_gpu and self.every_steps > 0:
            self._live = LiveTensors()

    @contextlib.contextmanager
    def tracking(self):
        """Count what the block allocates (and keep counting it while it lives) without a phase."""
        if self._live is None:
            yield
            return
        with self._live:
            yield

    def start_step(self, step: int) -> bool:
        """Whether step `step` (1-based) is metered; clears the last step's figures."""
        self._peaks = {}
        if self.on_gpu:
            self.metered = True
        else:
            self.metered = self._live is not None and (step == 1 or step % self.every_steps == 0)
        return self.metered

    @contextlib.contextmanager
    def measure(self, name: str):
        """Meter the block as phase `name` when this step is metered (else run it as it is)."""
        if not self.metered:
            yield
            return
        reset_rss_peak()
        started = time.monotonic()
        reserved = None
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            tensor = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device) / 1e9
        else:
            live = self._live
            live.seed(self.owned())
            live.reset_peak()
            with live:
                yield
            tensor = live.peak
        self.metered_s += time.monotonic() - started
        figures = {"tensor_gb": tensor / 1e9, "rss_gb": rss_peak_bytes() / 1e9}
        if reserved is not None:
            figures["reserved_gb"] = reserved
        before = self._peaks.get(name, {})  # a phase entered more than once (mini-batches): its worst moment
        self._peaks[name] = {k: max(v, before.get(k, 0.0)) for k, v in figures.items()}

    def peaks(self) -> dict[str, dict[str, float]]:
        """{phase: {"tensor_gb", "rss_gb"[, "reserved_gb" on a GPU]}} of this step's metered phases ({} when the
        step is not metered): the peaks of live tensor bytes (GPU: allocated), RSS and the GPU's reserved pool."""
        return {k: dict(v) for k, v in self._peaks.items()}


def process_rss_peak_gb(pid: int, reset: bool = False) -> float | None:
    """Another process's resident-set peak (VmHWM) in GB since it started or its last reset (then reset it, where
    `reset`): a colocated engine's, read by trainer rank 0 beside it. None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            peak = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024 / 1e9
        if reset:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        return peak
    except (OSError, AttributeError, ValueError):
        return None


def owned_tensors(*modules: torch.nn.Module, optimizer=None) -> list[torch.Tensor]:
    """The tensors a trainer rank holds between steps: every parameter and buffer of `modules`, their
    gradients, and the optimizer's state (Adam's moments)."""
    out: list[torch.Tensor] = []
    for module in modules:
        for p in module.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(module.buffers())
    if optimizer is not None:
        for state in getattr(optimizer, "state", {}).values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def step_memory(ranks: list[dict[str, dict[str, float]]] | None) -> dict:
    """The memory keys of one step's metrics row from every rank's `peaks()` (rank order); every key is
    there on every step, null when the step was not metered (docs/metrics.md)."""
    row: dict = {"mem_metered": False, "trainer_peak_gb": None, "trainer_peak_gb_by_rank": None,
                 "trainer_reserved_gb": None, "rss_peak_gb": None, "engine_rss_peak_gb": None,
                 **{f"mem_{p}_gb": None for p in PHASES}}
    if not ranks or not any(ranks):
        return row
    by_rank = [max((f["tensor_gb"] for f in r.values()), default=0.0) for r in ranks]
    row.update(mem_metered=True, trainer_peak_gb=max(by_rank), trainer_peak_gb_by_rank=by_rank,
               rss_peak_gb=max(f["rss_gb"] for r in ranks for f in r.values()))
    reserved = [f["reserved_gb"] for r in ranks for f in r.values() if "reserved_gb" in f]
    if reserved:
        row["trainer_reserved_gb"] = max(reserved)
    for phase in PHASES:
        seen = [r[phase]["tensor_gb"] for r in ranks if phase in r]
        if seen:
            row[f"mem_{phase}_gb"] = max(seen)
    return row
