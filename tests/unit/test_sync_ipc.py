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


# -- CUDA handles travel as typed JSON, never as a pickle ------------------------------------------------

def synthetic_cuda_args() -> tuple:
    """What reduce_tensor returns for a CUDA uint8 bucket (torch 2.13), with made-up handle bytes."""
    return (torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0,
            b"\x00\x01cuda-ipc-mem-handle\xff" * 3, 4096, 512, False, b"/torch_77_88_0", 3, b"\x10event\x00", True)


def test_cuda_handle_args_round_trip_through_json():
    import json

    handle = json.loads(json.dumps(ipc.encode_cuda(synthetic_cuda_args())))
    assert handle["kind"] == "cuda" and handle["dtype"] == "uint8" and handle["tensor_cls"] == "Tensor"
    assert ipc.decode_cuda(handle) == synthetic_cuda_args()
    no_event = synthetic_cuda_args()[:13] + (None, False)
    assert ipc.decode_cuda(json.loads(json.dumps(ipc.encode_cuda(no_event)))) == no_event


@pytest.mark.parametrize("change, words", [
    ({"tensor_cls": "os.system"}, "names classes"),
    ({"storage_cls": "subprocess.Popen"}, "names classes"),
    ({"dtype": "object"}, "not one of"),
    ({"blob": "gASV"}, "unknown fields"),
    ({"kind": "pickle"}, "not a CUDA IPC handle"),
    ({"size": [-1]}, "ints >= 0"),
    ({"device": "0"}, "must be an int"),
    ({"requires_grad": 1}, "must be a bool"),
    ({"handle": "not base64!"}, "Non-base64|Only base64|Invalid"),
])
def test_a_cuda_handle_off_the_schema_is_refused(change, words):
    import binascii

    handle = {**ipc.encode_cuda(synthetic_cuda_args()), **change}
    with pytest.raises((ValueError, binascii.Error), match=words):
        ipc.decode_cuda(handle)


def test_encoding_refuses_what_reduce_tensor_would_not_give():
    args = list(synthetic_cuda_args())
    args[0] = torch.nn.Parameter
    with pytest.raises(ValueError, match="tensor class"):
        ipc.encode_cuda(tuple(args))
    with pytest.raises(ValueError, match="takes 15 args"):
        ipc.encode_cuda(tuple(args[:5]))


def test_the_ready_path_must_be_a_fifo(tmp_path):
    regular = tmp_path / "not-a-fifo"
    regular.write_text("")
    with pytest.raises(ValueError, match="is not a FIFO"):
        ipc.receive([{"name": "w", "dtype": "float32", "shape": [1]}], BUCKET_BYTES,
                    [ipc.share(torch.zeros(16, dtype=torch.uint8))], Landing(DictEngine(make(0)), staged=True),
                    ready={"fifo": str(regular), "generation": 1}, timeout_s=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_bucket_is_mapped_by_another_process_from_its_json_handle():
    import json
    import subprocess
    import sys

    bucket = torch.arange(256, dtype=torch.uint8, device="cuda")
    handle = json.dumps(ipc.share(bucket))
    code = ("import json, sys, torch; from rlslurm.sync import ipc; "
            "t = ipc.attach(json.loads(sys.stdin.read())); print(int(t.sum()), t.device.type)")
    done = subprocess.run([sys.executable, "-c", code], input=handle, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(bucket.sum())), "cuda"]
