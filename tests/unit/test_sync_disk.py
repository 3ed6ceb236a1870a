"""The disk transport's file side: a version appears only complete, keeps HF names and exact bytes,
old versions are pruned, a corrupted copy never touches the trainer's tensor, and the engine's
reader lands every dtype bit-exactly straight from the file (and refuses a truncated one)."""

from __future__ import annotations

import pytest
import torch
from test_sync_landing import DictEngine

from rlslurm.sync.buckets import Fault
from rlslurm.sync.checksum import checksums
from rlslurm.sync.disk import WEIGHTS_FILE, DiskTransport, read_weights, receive, version_dir, write_weights
from rlslurm.sync.landing import Landing


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


def mixed() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(33, 17), "h": torch.randn(5).half(), "b": torch.randn(3, 3).bfloat16(),
            "i": torch.arange(7, dtype=torch.int64), "u": torch.arange(5, dtype=torch.uint8),
            "e": torch.empty(0, 4), "big": torch.randn(70_000)}


@pytest.mark.parametrize("bucket_bytes", [64, 4096, 1 << 30])
def test_the_engine_reads_every_tensor_bit_exactly(tmp_path, bucket_bytes):
    new = mixed()
    engine = DictEngine({n: torch.zeros_like(t) for n, t in new.items()})
    landing = Landing(engine, staged=True)
    assert receive(write_weights(new, tmp_path, 1), landing, bucket_bytes) == sum(
        t.numel() * t.element_size() for t in new.values())
    landing.finish()
    assert landing.checksums == checksums(new.items())
    landing.commit()
    assert checksums(engine.named_weights()) == checksums(new.items())


def test_a_truncated_file_is_refused(tmp_path):
    path = write_weights(mixed(), tmp_path, 1)
    with open(path / WEIGHTS_FILE, "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    engine = DictEngine({n: torch.zeros_like(t) for n, t in mixed().items()})
    with pytest.raises(ValueError, match="file ends at byte"):
        receive(path, Landing(engine, staged=True))


def test_the_transport_prunes_old_versions_after_the_engines_loaded(tmp_path):
    class Engine:
        def update_disk(self, path, timeout_s):
            assert (tmp_path / path).exists()

    transport = DiskTransport(tmp_path, keep=2)
    for v in range(1, 5):
        transport.send({"w": torch.ones(3) * v}, [Engine()], v, timeout_s=5)
    transport.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004"]
