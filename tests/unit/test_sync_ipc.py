"""The IPC transport's engine side in one process: buckets land only once announced on the FIFO, in
order; records of an older sync are skipped; a trainer that goes away or falls silent fails the
receive instead of hanging it."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch
from test_sync_landing import DictEngine, make

from rlslurm.sync import ipc
from rlslurm.sync.buckets import flatten_into, manifest_of, plan_buckets
from rlslurm.sync.checksum import checksums
from rlslurm.sync.landing import Landing

BUCKET_BYTES = 2048


@pytest.fixture()
def shared(tmp_path):
    tensors = make(1)
    manifest = manifest_of(tensors)
    buckets = plan_buckets(manifest, BUCKET_BYTES)
    buffers = [torch.empty(b.nbytes, dtype=torch.uint8) for b in buckets]
    for buf, bucket in zip(buffers, buckets):
        flatten_into(buf, bucket, tensors)
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    yield tensors, manifest, [ipc.share(b) for b in buffers], len(buckets), str(fifo), fd
    with contextlib.suppress(OSError):
        os.close(fd)


def announce(fd: int, generation: int, index: int) -> None:
    os.write(fd, ipc._RECORD.pack(generation, index))


def test_buckets_land_as_they_are_announced_and_stale_records_are_skipped(shared):
    tensors, manifest, handles, n, fifo, fd = shared
    landing = Landing(DictEngine(make(0)), staged=True)
    announce(fd, 6, 0)  # left over from a sync that failed half-way
    announce(fd, 7, 0)
    done = []
    receiver = threading.Thread(target=lambda: done.append(ipc.receive(
        manifest, BUCKET_BYTES, handles, landing, ready={"fifo": fifo, "generation": 7}, timeout_s=10)))
    receiver.start()
    for i in range(1, n):
        announce(fd, 7, i)
    receiver.join(10)
    assert done and landing.finish() and landing.checksums == checksums(tensors.items())


def test_a_silent_trainer_times_out_and_a_wrong_bucket_is_refused(shared):
    tensors, manifest, handles, n, fifo, fd = shared
    with pytest.raises(TimeoutError, match="did not announce bucket 0"):
        ipc.receive(manifest, BUCKET_BYTES, handles, Landing(DictEngine(make(0)), staged=True),
                    ready={"fifo": fifo, "generation": 3}, timeout_s=0.2)
    announce(fd, 3, 1)
    with pytest.raises(ValueError, match="expected bucket 0"):
        ipc.receive(manifest, BUCKET_BYTES, handles, Landing(DictEngine(make(0)), staged=True),
                    ready={"fifo": fifo, "generation": 3}, timeout_s=5)


def test_a_trainer_that_goes_away_fails_the_receive_at_once(shared):
    tensors, manifest, handles, n, fifo, fd = shared
    landing = Landing(DictEngine(make(0)), staged=True)
    errors = []

    def receive():
        try:
            ipc.receive(manifest, BUCKET_BYTES, handles, landing, ready={"fifo": fifo, "generation": 1},
                        timeout_s=30)
        except ConnectionError as e:
            errors.append(e)

    receiver = threading.Thread(target=receive)
    receiver.start()
    announce(fd, 1, 0)
    deadline = time.monotonic() + 10
    while not landing.bytes and time.monotonic() < deadline:  # the engine is now waiting for bucket 1
        time.sleep(0.01)
    os.close(fd)  # the trainer's end, closed as a dying process closes it
    receiver.join(10)
    assert not receiver.is_alive() and "closed its FIFO before bucket 1" in str(errors[0])
