"""Sync throughput per transport, for the tiny model and a ~100 MB set of tensors (a Llama of
hidden 512 x 11 layers, float32), through the real protocol and a real engine server process.

    python -m pytest -q -s tests/integration/test_sync_throughput.py   # prints the table

Asserts only what must hold (every sync verified, exact greedy output, bytes accounted); the
GB/s figures are printed for the README and the planner's calibration, not gated.
"""

from __future__ import annotations

import pytest

from rlslurm.rollout.engine import HFEngine
from rlslurm.sync.broadcast import BroadcastTransport
from rlslurm.sync.config import SyncConfig
from rlslurm.sync.disk import DiskTransport
from rlslurm.sync.ipc import IpcTransport
from rlslurm.sync.protocol import WeightSync
from rollout_fixtures import PROMPTS, greedy_tokens, save_model, served_tokens, start_engine, tiny_llama, weights

SIZES = {"tiny": dict(hidden=32, layers=2), "100MB": dict(hidden=512, layers=11)}


@pytest.mark.slow
@pytest.mark.parametrize("size", list(SIZES))
def test_sync_gbps_per_transport(size, tmp_path):
    shape = SIZES[size]
    base = save_model(tiny_llama(0, **shape), tmp_path / "m0")
    new_model = tiny_llama(1, **shape)
    new = weights(new_model)
    total = sum(t.numel() * t.element_size() for t in new.values())
    if size == "100MB":
        assert 90e6 < total < 130e6
    expected = greedy_tokens(HFEngine(save_model(new_model, tmp_path / "m1")), max_new_tokens=4)
    engine = start_engine(base, tmp_path)
    rows = []
    try:
        transports = [DiskTransport(tmp_path / "w"), BroadcastTransport(bucket_mb=64), IpcTransport(bucket_mb=64)]
        for version, transport in enumerate(transports * 2, start=1):
            report = WeightSync([engine.client], transport, SyncConfig(timeout_s=120)).sync(new, version)
            assert report.attempts == 1 and report.stages["update"].bytes == total
            if version > len(transports):  # second round: groups and shared buffers already built
                m = report.metrics()
                rows.append((transport.name, m["sync_drain_s"], m["sync_update_s"], m["sync_update_gbps"],
                             m["sync_verify_s"], m["sync_resume_s"], m["sync_s"], total / m["sync_s"] / 1e9))
        out = engine.client.completions(PROMPTS, max_tokens=4, temperature=0)
        assert served_tokens(out) == expected and out["policy_version"] == 2 * len(transports)
    finally:
        for t in transports:
            t.close()
        engine.stop()
    print(f"\nsync of {total / 1e6:.1f} MB ({size}), one engine, loopback:")
    print(f"{'transport':10} {'drain s':>8} {'update s':>9} {'upd GB/s':>9} {'verify s':>9} {'resume s':>9} "
          f"{'total s':>8} {'end GB/s':>9}")
    for r in rows:
        print(f"{r[0]:10} {r[1]:8.3f} {r[2]:9.3f} {r[3]:9.3f} {r[4]:9.3f} {r[5]:9.3f} {r[6]:8.3f} {r[7]:9.3f}")
