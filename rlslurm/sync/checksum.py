"""Per-tensor checksums of named weights, computed the same way on the trainer and on an engine.

VERIFY compares, name by name, what the trainer sent with what the engine serves. The checksum runs
with torch ops on the tensor's own device (no copy of 70 GB through PCIe to hash on the host) and is
exact on every device: the tensor's bytes are read as int32 words and reduced with integer sums, which
wrap modulo 2**64 and do not depend on reduction order, so a CPU trainer and a GPU engine agree.

    sums = checksums(model.state_dict().items())   # {name: "float32[64,32]:9f..:1c.."}
    bad = compare(expected, sums)                  # names that differ, are missing or extra

It is not cryptographic: it catches corruption (a flipped bit, a truncated or stale tensor, a
half-applied update), not an adversary.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

_CHUNK_WORDS = 1 << 24  # 64 MB of int32 words per step bounds the int64 temporaries to ~256 MB
_MASK64 = (1 << 64) - 1
# Odd multipliers make the position-weighted sum sensitive to where a change lands, so swapping
# two words or moving a block also changes the checksum (a plain sum would not see it).
_MUL_A = 0x9E3779B1
_MUL_B = 0x7F4A7C15


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int32 view (zero-padded to whole words)."""
    t = tensor.detach().contiguous()
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.int32, device=t.device)
    raw = t.view(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad or raw.storage_offset() % 4:  # a view at an odd byte offset cannot be read as int32 in place
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32)


def tensor_checksum(tensor: torch.Tensor) -> str:
    """`dtype[shape]:plain_sum:weighted_sum` of one tensor, in hex; equal bytes give equal strings."""
    words = _words(tensor)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS].to(torch.int64)
        index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=words.device)
        plain += chunk.sum()
        weighted += (chunk * (index * _MUL_A + _MUL_B)).sum()
    shape = ",".join(str(d) for d in tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{shape}]:{int(plain) & _MASK64:016x}:{int(weighted) & _MASK64:016x}"


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: tensor_checksum} for every named tensor."""
    return {name: tensor_checksum(t) for name, t in named}


def compare(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[dict]:
    """Every name whose checksum differs or that only one side has, with both values as evidence.

    An engine may hold tensors the trainer does not send (tied aliases, buffers); only the names
    the trainer sent are compared, and each of them must be present on the engine.
    """
    problems = []
    for name, want in expected.items():
        got = actual.get(name)
        if got != want:
            problems.append({"name": name, "expected": want, "actual": got})
    return problems
