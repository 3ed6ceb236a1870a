"""Per-tensor checksums: equal bytes agree, any single flipped bit, moved block or changed
shape/dtype disagrees, and compare() names what differs or is missing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlslurm.sync.checksum import checksums, compare, tensor_checksum

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_bytes_agree_and_copies_agree(dtype):
    t = (torch.randn(7, 5) * 50).to(dtype)
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    assert tensor_checksum(t.t().contiguous().t()) == tensor_checksum(t)  # layout does not matter
    assert tensor_checksum(t).startswith(str(dtype).removeprefix("torch.") + "[7,5]:")


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), seed=st.integers(0, 2**16), data=st.data())
def test_any_single_bit_flip_changes_the_checksum(numel, seed, data):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(numel, generator=g)
    raw = t.clone().view(torch.uint8)
    byte = data.draw(st.integers(0, raw.numel() - 1))
    bit = data.draw(st.integers(0, 7))
    raw[byte] ^= 1 << bit
    assert tensor_checksum(raw.view(torch.float32)) != tensor_checksum(t)


def test_swapping_two_values_and_reshaping_are_seen():
    t = torch.arange(12, dtype=torch.float32)
    swapped = t.clone()
    swapped[[2, 9]] = swapped[[9, 2]]
    assert tensor_checksum(swapped) != tensor_checksum(t)  # a plain sum would miss this
    assert tensor_checksum(t.view(3, 4)) != tensor_checksum(t.view(4, 3))
    assert tensor_checksum(t) != tensor_checksum(t.view(torch.int32))


def test_odd_byte_counts_are_padded_not_dropped():
    t = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert tensor_checksum(t) != tensor_checksum(torch.tensor([1, 2, 4], dtype=torch.uint8))


def test_compare_names_differences_and_missing_tensors():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    expected = checksums(a.items())
    actual = checksums({"w": torch.ones(3) * 2, "extra": torch.ones(1)}.items())
    problems = compare(expected, actual)
    assert [(p["name"], p["actual"] is None) for p in problems] == [("w", False), ("b", True)]
    assert compare(expected, checksums(a.items())) == []
