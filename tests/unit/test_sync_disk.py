"""The disk transport's file side: a version appears only complete, keeps HF names and exact bytes,
old versions are pruned, and a corrupted copy never touches the trainer's tensor."""

from __future__ import annotations

import torch

from rlslurm.sync.buckets import Fault
from rlslurm.sync.disk import read_weights, version_dir, write_weights


def test_versions_are_complete_exact_and_pruned(tmp_path):
    tensors = {"model.embed_tokens.weight": torch.randn(5, 3), "lm_head.weight": torch.randn(5, 3).bfloat16()}
    for v in (1, 2, 3):
        path = write_weights(tensors, tmp_path, v, keep=2)
        assert path == version_dir(tmp_path, v)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]  # no temp dirs left
    back = read_weights(version_dir(tmp_path, 3))
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_a_retry_of_the_same_version_replaces_it_and_faults_hit_the_copy(tmp_path):
    w = torch.zeros(8)
    write_weights({"w": w}, tmp_path, 1, fault=Fault("w"))
    assert torch.equal(w, torch.zeros(8))
    assert not torch.equal(read_weights(version_dir(tmp_path, 1))["w"], w)
    write_weights({"w": w}, tmp_path, 1)
    assert torch.equal(read_weights(version_dir(tmp_path, 1))["w"], w)
