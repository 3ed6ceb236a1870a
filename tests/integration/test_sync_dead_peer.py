"""A dead engine makes the sync raise within sync.timeout_s instead of hanging the trainer: killed
in the middle of a broadcast (between two buckets), or gone before the sync starts."""

from __future__ import annotations

import time

import pytest

from rlslurm.sync.broadcast import BroadcastTransport
from rlslurm.sync.config import SyncConfig
from rlslurm.sync.protocol import SyncStageError, WeightSync
from rollout_fixtures import save_model, start_engine, tiny_llama, weights

TIMEOUT_S = 10.0


@pytest.fixture()
def engine(tmp_path):
    proc = start_engine(save_model(tiny_llama(0), tmp_path / "m0"), tmp_path)
    yield proc
    proc.stop()


def test_engine_killed_mid_broadcast_raises_within_the_timeout(engine):
    killed_after = []

    def kill_after_first_bucket(i):
        if i == 0:
            engine.proc.kill()
            engine.proc.wait(5)
            killed_after.append(i)

    # A tiny bucket size makes every tensor its own bucket, so the kill lands mid-transfer.
    transport = BroadcastTransport("127.0.0.1", bucket_mb=0.001, on_bucket=kill_after_first_bucket)
    proto = WeightSync([engine.client], transport, SyncConfig(timeout_s=TIMEOUT_S, retries=0))
    started = time.monotonic()
    with pytest.raises(SyncStageError) as failed:
        proto.sync(weights(tiny_llama(1)), version=1)
    elapsed = time.monotonic() - started
    assert killed_after == [0]
    assert "update" in str(failed.value)
    assert elapsed < TIMEOUT_S + 3, f"a dead peer took {elapsed:.1f} s to surface"
    assert transport.group is None  # the broken group is dropped, the next sync rebuilds it


def test_engine_gone_before_the_sync_fails_the_drain_fast(engine):
    engine.proc.kill()
    engine.proc.wait(5)
    proto = WeightSync([engine.client], BroadcastTransport("127.0.0.1"), SyncConfig(timeout_s=TIMEOUT_S))
    started = time.monotonic()
    with pytest.raises(SyncStageError, match="stage drain failed"):
        proto.sync(weights(tiny_llama(1)), version=1)
    assert time.monotonic() - started < TIMEOUT_S
