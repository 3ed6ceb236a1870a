"""Per-tensor checksums: equal bytes agree, any single flipped bit, moved block or changed
shape/dtype disagrees, and compare() names what differs or is missing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlslurm.sync.checksum import Checksum, checksums, compare, finish, tensor_checksum

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


ROW_BYTES = 8192  # rlslurm.sync.checksum.ROW_BYTES: tensors above it span several rows


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(1, 3 * ROW_BYTES), seed=st.integers(0, 2**16),
       data=st.data())
def test_any_single_changed_element_is_seen_in_every_dtype(dtype, numel, seed, data):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(numel, generator=g) * 50).to(dtype)
    i = data.draw(st.integers(0, numel - 1))
    changed = t.clone()
    raw = changed.view(torch.uint8).view(numel, -1)
    raw[i] = raw[i] ^ torch.tensor(data.draw(st.integers(1, 255)), dtype=torch.uint8)  # any new value
    assert tensor_checksum(changed) != tensor_checksum(t)


@pytest.mark.parametrize("a,b", [(0, 1), (0, 2), (5, 5000), (10, 10 + 2048), (3, 90_000), (0, 99_999)])
def test_swapped_elements_are_seen_in_one_word_one_row_or_across_rows(a, b):
    t = torch.randn(100_000)  # 49 rows of 8 KiB: same word (0,1), same row, other rows, last row
    swapped = t.clone()
    swapped[[a, b]] = swapped[[b, a]]
    assert tensor_checksum(swapped) != tensor_checksum(t)


def test_swapped_tensors_are_named_by_compare():
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    problems = compare(checksums({"q": a, "k": b}.items()), checksums({"q": b, "k": a}.items()))
    assert [p["name"] for p in problems] == ["q", "k"]


def test_views_at_any_byte_offset_and_non_contiguous_tensors_agree_with_their_copies():
    base = torch.randn(3 * ROW_BYTES)
    for start in (0, 1, 3, 2048, 2049):  # 4-byte steps: offsets that are not whole int64 words
        view = base[start : start + 2 * ROW_BYTES + 5]
        assert tensor_checksum(view) == tensor_checksum(view.clone())
    bf = torch.randn(301, 77).bfloat16()
    assert tensor_checksum(bf[1:]) == tensor_checksum(bf[1:].clone())
    assert tensor_checksum(bf.t()) == tensor_checksum(bf.t().contiguous())


def test_zero_dim_and_empty_tensors():
    assert tensor_checksum(torch.tensor(1.5)) != tensor_checksum(torch.tensor(2.5))
    assert tensor_checksum(torch.empty(0, 4)).startswith("float32[0,4]:")
    assert tensor_checksum(torch.empty(0, 4)) != tensor_checksum(torch.empty(4, 0))


@pytest.mark.parametrize("numel,piece", [(100_000, 8192), (100_000, 65536), (2048, 8192), (5, 8192)])
def test_a_checksum_fed_in_pieces_equals_the_whole_one(numel, piece):
    t = torch.randn(numel)
    raw = t.view(torch.uint8)
    c = Checksum.like(t)
    for start in range(0, raw.numel(), piece):
        c.update(raw[start : start + piece])
    assert finish({"t": c}) == {"t": tensor_checksum(t)}
    with pytest.raises(ValueError, match="inside a row"):
        Checksum.like(t).update(raw[:100]).update(raw[100:])
