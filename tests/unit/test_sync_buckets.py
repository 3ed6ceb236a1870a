"""The broadcast/IPC wire format: bucket plans respect the size bound and order, flatten/unflatten
round-trip any mix of dtypes bit-exactly, and the corruption hook flips exactly what it names."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from rlslurm.sync.buckets import Fault, bucket_nbytes, flatten_into, manifest_of, plan_buckets, unflatten

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float16, torch.int64]


def make(shapes_dtypes):
    return {f"t{i}": (torch.randn(shape) * 100).to(dtype) for i, (shape, dtype) in enumerate(shapes_dtypes)}


shapes = st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=0, max_size=3), st.sampled_from(DTYPES)),
                  min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(spec=shapes, bucket_bytes=st.integers(1, 2000))
def test_plan_is_ordered_bounded_and_round_trips(spec, bucket_bytes):
    tensors = make(spec)
    manifest = manifest_of(tensors)
    buckets = plan_buckets(manifest, bucket_bytes)
    assert [e.name for b in buckets for e in b.entries] == list(tensors)
    for b in buckets:
        assert bucket_nbytes(b) <= bucket_bytes or len(b.entries) == 1  # only a lone large tensor may exceed
        assert all(o % 16 == 0 for o in b.offsets)  # any dtype can be viewed in place
    got = {}
    for b in buckets:
        flat = flatten_into(torch.empty(bucket_nbytes(b), dtype=torch.uint8), b, tensors)
        got.update({n: t.clone() for n, t in unflatten(flat, b)})
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_fault_flips_one_bit_of_the_named_tensor_only_times_times():
    t = torch.ones(4)
    fault = Fault("w", times=1)
    corrupted = fault.apply("w", t)
    assert torch.equal(t, torch.ones(4))  # the trainer's own tensor stays intact
    assert (corrupted != t).sum() == 1
    assert fault.apply("w", t) is t and fault.apply("other", t) is t and fault.hits == 1


def test_fault_from_env():
    assert Fault.from_env({}) is None
    f = Fault.from_env({"RLSLURM_SYNC_CORRUPT": "lm_head.weight:3"})
    assert (f.tensor, f.times) == ("lm_head.weight", 3)
