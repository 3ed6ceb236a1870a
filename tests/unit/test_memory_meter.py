"""rlslurm/memory_meter.py: the CPU live-tensor meter counts what an allocator would hold, phase by phase."""

from __future__ import annotations

import torch

from rlslurm.memory_meter import LiveTensors, MemoryMeter, step_memory

MB = 1_000_000


def test_live_storage_is_counted_once_per_storage_and_freed_with_it():
    live = LiveTensors()
    with live:
        a = torch.ones(MB // 4)  # 1 MB
        view = a[: MB // 8]  # a view: no new storage
        b = a * 2  # 1 MB more
        assert live.live == 2 * MB and view.numel() == MB // 8
        del b
        assert live.live == MB  # freed when its storage dies
        c = torch.ones(3 * MB // 4)  # 3 MB: the peak is 1 + 3
        del c
    assert live.peak == 4 * MB and live.live == MB
    del a, view
    assert live.live == 0


def test_seeded_tensors_count_from_the_start_and_their_free_is_seen():
    held = torch.ones(MB // 4)
    live = LiveTensors()
    live.seed([held])
    live.reset_peak()
    with live:
        tmp = held + 1
        del tmp
    assert (live.peak, live.live) == (2 * MB, MB)


def test_the_meter_measures_metered_steps_only_and_each_phase_at_its_worst():
    held = torch.ones(MB // 4)
    meter = MemoryMeter(torch.device("cpu"), every_steps=3, owned=lambda: [held])
    assert meter.start_step(1) and not meter.start_step(2) and meter.start_step(3)
    for size_mb in (2, 5):  # a phase entered twice (two mini-batches): its worst moment counts
        with meter.measure("forward_backward"):
            x = torch.ones(size_mb * MB // 4)
            del x
    with meter.measure("optimizer"):
        pass
    peaks = meter.peaks()
    assert peaks["forward_backward"]["tensor_gb"] == (1 + 5) * MB / 1e9
    assert peaks["optimizer"]["tensor_gb"] == MB / 1e9
    assert all(p["rss_gb"] > 0 for p in peaks.values())
    assert not meter.start_step(4) and meter.peaks() == {}


def test_a_step_row_has_every_key_whether_metered_or_not():
    empty = step_memory(None)
    ranks = [{"forward_backward": {"tensor_gb": 0.5, "rss_gb": 1.0}, "optimizer": {"tensor_gb": 0.3, "rss_gb": 1.1}},
             {"forward_backward": {"tensor_gb": 0.6, "rss_gb": 0.9}}]
    full = step_memory(ranks)
    assert set(empty) == set(full) and empty["mem_metered"] is False and all(
        v is None for k, v in empty.items() if k != "mem_metered")
    assert (full["trainer_peak_gb"], full["trainer_peak_gb_by_rank"], full["rss_peak_gb"]) == (0.6, [0.5, 0.6], 1.1)
    assert (full["mem_forward_backward_gb"], full["mem_optimizer_gb"], full["mem_sync_gb"]) == (0.6, 0.3, None)
