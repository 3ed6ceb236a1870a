"""The disk transport's file side: a version appears only complete, keeps HF names and exact bytes,
old versions are pruned, a corrupted copy never touches the trainer's tensor, and the engine's
reader lands every dtype bit-exactly straight from the file (and refuses a truncated one)."""

from __future__ import annotations

import pytest
import torch
from test_sync_landing import DictEngine

from rlslurm.sync.buckets import Fault
from rlslurm.sync.checksum import checksums
from rlslurm.sync.disk import (
    INDEX_FILE,
    WEIGHTS_FILE,
    DiskTransport,
    read_weights,
    receive,
    shard_files,
    version_dir,
    write_weights,
)
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


@pytest.mark.parametrize("shard_bytes", [None, 1000])
@pytest.mark.parametrize("bucket_bytes", [64, 4096, 1 << 30])
def test_the_engine_reads_every_tensor_bit_exactly(tmp_path, bucket_bytes, shard_bytes):
    new = mixed()
    engine = DictEngine({n: torch.zeros_like(t) for n, t in new.items()})
    landing = Landing(engine, staged=True)
    assert receive(write_weights(new, tmp_path, 1, shard_bytes=shard_bytes), landing, bucket_bytes) == sum(
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


def test_shards_follow_hugging_faces_index_and_read_back_exactly(tmp_path):
    import json

    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

    tensors = mixed()
    path = write_weights(tensors, tmp_path, 1, shard_bytes=1000)
    files = shard_files(path)
    assert INDEX_FILE == SAFE_WEIGHTS_INDEX_NAME and len(files) > 2
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    index = json.loads((path / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(tensors) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert sorted(p.name for p in path.iterdir()) == sorted([*files, INDEX_FILE])  # no .part left
    back = read_weights(path)
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_shard_is_announced_only_whole_and_the_version_only_after_all_of_them(tmp_path):
    """Crash safety of the pipeline: the callback sees each shard complete (it parses in full) while the
    version's directory does not exist yet; a failure while loading leaves no version and no temp dir."""
    tensors = mixed()
    seen = []

    def on_shard(directory, file):
        assert not version_dir(tmp_path, 1).exists()
        part = read_weights(directory, [file])  # a whole safetensors file, every tensor exact
        assert all(torch.equal(part[n], tensors[n]) for n in part)
        seen.append(file)

    path = write_weights(tensors, tmp_path, 1, shard_bytes=1000, on_shard=on_shard)
    assert seen == shard_files(path)

    def refuse(directory, file):
        raise ValueError("engine refused the shard")

    with pytest.raises(ValueError, match="refused"):
        write_weights(tensors, tmp_path, 2, shard_bytes=1000, on_shard=refuse)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001"]


def test_an_engine_that_takes_shards_loads_one_while_the_next_is_written(tmp_path):
    """Each shard's load waits until the trainer has started on the next shard (its file or the version's
    index exists): a transport that wrote shard k + 1 only after shard k's load returned would never get there."""
    import threading

    calls = []

    class ShardEngine:
        def begin_disk_update(self, timeout_s):
            calls.append("begin")

        def update_disk_shard(self, path, files, timeout_s):
            from pathlib import Path

            (file,) = files
            k, n = int(file[6:11]), int(file[15:20])
            nxt = Path(path) / (f"model-{k + 1:05d}-of-{n:05d}.safetensors" if k < n else INDEX_FILE)
            part = Path(path) / f".{nxt.name}.part"
            ready = threading.Event()
            for _ in range(500):
                if nxt.exists() or part.exists() or version_dir(tmp_path, 1).exists():
                    ready.set()
                    break
                threading.Event().wait(0.01)
            assert ready.is_set() or k == n, f"shard {k + 1} was not being written while shard {k} loaded"
            calls.append(file)

        def finish_disk_update(self, timeout_s):
            calls.append("finish")

    transport = DiskTransport(tmp_path, shard_bytes=1000)
    tensors = mixed()
    assert transport.send(tensors, [ShardEngine()], 1, timeout_s=5) == sum(
        t.numel() * t.element_size() for t in tensors.values())
    transport.close()
    files = shard_files(version_dir(tmp_path, 1))
    assert calls == ["begin", *files, "finish"] and len(files) > 2
