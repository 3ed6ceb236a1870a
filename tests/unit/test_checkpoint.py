"""Atomic checkpoints on a real filesystem: manifest, rename, `latest`, verification, retention, cleanup."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlslurm.checkpoint import Checkpoint, CheckpointWriter, latest_complete, prune, survey, write_rank_state
from rlslurm.errors import CheckpointError
from rlslurm.events import read_events
from rlslurm.rundir import RunDir


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir(tmp_path / "run").create()


def _save(run: RunDir, step: int, **kw) -> CheckpointWriter:
    with CheckpointWriter(run, step, **kw) as ckpt:
        ckpt.save_tensors("model", {"model.embed_tokens.weight": torch.full((4, 3), float(step))})
        ckpt.save_json("trainer", {"step": step})
    return ckpt


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_round_trip_of_tensors_state_and_json(run):
    linear = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(linear.parameters())
    linear(torch.ones(1, 3)).sum().backward()
    opt.step()
    np.random.seed(7)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    with CheckpointWriter(run, 12, policy_version=3, metadata={"world_size": 2}) as ckpt:
        ckpt.save_tensors("model", linear.state_dict(), metadata={"format": "pt"})
        ckpt.save_state("optimizer", opt.state_dict())
        ckpt.save_state("rng", rng)
        ckpt.save_json("trainer", {"data_position": 96})

    loaded = latest_complete(run)
    assert (loaded.name, loaded.step, loaded.policy_version) == ("step-00000012", 12, 3)
    tensors = loaded.load_tensors("model")
    assert tensors.keys() == linear.state_dict().keys()
    assert all(torch.equal(tensors[k], v) for k, v in linear.state_dict().items())
    assert loaded.load_state("optimizer")["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    np.random.set_state(loaded.load_state("rng")["numpy"])
    assert np.random.rand() == np.random.RandomState(7).rand()
    assert loaded.load_json("trainer") == {"data_position": 96}
    assert loaded.manifest["metadata"] == {"world_size": 2}
    with pytest.raises(CheckpointError, match="has no missing.pt"):
        loaded.load_state("missing")


def test_manifest_lists_sizes_and_sha256_and_latest_moves(run):
    saved = _save(run, 5).saved
    manifest = json.loads((saved.path / "manifest.json").read_text())
    for name, facts in manifest["files"].items():
        data = (saved.path / name).read_bytes()
        assert facts == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert (run.checkpoints / "latest").read_text() == "step-00000005\n"
    _save(run, 9)
    assert (run.checkpoints / "latest").read_text() == "step-00000009\n"
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["latest", "step-00000005", "step-00000009"]
    (event,) = [e for e in read_events(run, "checkpoint_saved") if e["step"] == 5]
    assert event["bytes"] == saved.bytes == sum(f["bytes"] for f in manifest["files"].values())
    assert event["seconds"] > 0


def test_error_inside_the_block_leaves_no_checkpoint(run):
    with pytest.raises(RuntimeError):
        with CheckpointWriter(run, 3) as ckpt:
            ckpt.save_json("trainer", {})
            raise RuntimeError("boom")
    assert list(run.checkpoints.iterdir()) == []
    assert latest_complete(run) is None


def test_a_failed_save_says_so_and_keeps_the_newest_complete(run):
    _save(run, 2)
    with pytest.raises(OSError):
        with CheckpointWriter(run, 4) as ckpt:
            ckpt.save_json("trainer", {})
            raise OSError(28, "No space left on device")  # a real full disk: failures.disk_full
    (event,) = read_events(run, "checkpoint_failed")
    assert (event["step"], event["errno"], event["disk_full"], event["newest_complete"]) == \
        (4, "ENOSPC", True, "step-00000002")
    assert event["free_bytes"] > 0 and event["error"] == "OSError: [Errno 28] No space left on device"
    with pytest.raises(RuntimeError):  # no errno and plenty of room: a failure, not a full disk
        with CheckpointWriter(run, 6):
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert read_events(run, "checkpoint_failed")[-1]["disk_full"] is False
    assert latest_complete(run).step == 2 and sorted(p.name for p in run.checkpoints.iterdir()) == \
        ["latest", "step-00000002"]


def test_survey_names_what_a_resume_skips_and_changes_nothing(run):
    _save(run, 10)
    (_save(run, 20).saved.path / "trainer.json").write_text("{}")
    found = survey(run)
    assert found.chosen.step == 10
    assert found.skipped == [{"step": 20, "checkpoint": "step-00000020", "moved_to": "step-00000020",
                              "reason": "size mismatch in trainer.json: 2 bytes on disk, manifest says 15"}]
    assert (run.checkpoints / "step-00000020").is_dir() and read_events(run, "checkpoint_skipped") == []


def test_bad_or_repeated_file_names_are_refused(run):
    ckpt = CheckpointWriter(run, 1)
    with pytest.raises(CheckpointError, match="must match"):
        ckpt.save_json("../escape", {})
    ckpt.save_json("trainer", {})
    with pytest.raises(CheckpointError, match="written twice"):
        ckpt.save_json("trainer", {})
    ckpt.abort()


def test_shards_written_by_other_ranks_are_in_the_manifest_and_checked(run):
    with CheckpointWriter(run, 4) as ckpt:
        # What ranks 1 and 2 do in rlslurm/rl/checkpointing.py's save: their shard straight into rank 0's temp dir.
        names = [write_rank_state(ckpt.tmp, f"optimizer-tp{r:03d}", {"rank": r, "m": torch.full((3,), float(r))})
                 for r in (1, 2)]
        for name in names:
            ckpt.add_written(name)
        ckpt.save_json("trainer", {})
    loaded = latest_complete(run)
    assert sorted(loaded.manifest["files"]) == ["optimizer-tp001.pt", "optimizer-tp002.pt", "trainer.json"]
    assert loaded.has_state("optimizer-tp002") and not loaded.has_state("optimizer-tp003")
    assert torch.equal(loaded.load_state("optimizer-tp002")["m"], torch.full((3,), 2.0))
    # A shard changed after the commit makes the whole checkpoint unusable, as any other file would.
    with open(loaded.path / "optimizer-tp001.pt", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="optimizer-tp001.pt"):
        Checkpoint.open(loaded.path)


def test_a_shard_that_was_not_written_or_is_listed_twice_is_refused(run):
    ckpt = CheckpointWriter(run, 2)
    with pytest.raises(CheckpointError, match="was not written"):
        ckpt.add_written("optimizer-tp000.pt")
    with pytest.raises(CheckpointError, match="was not written"):
        ckpt.add_written("../step-00000001/model.safetensors")
    with pytest.raises(CheckpointError, match="must match"):
        write_rank_state(ckpt.tmp, "../escape", {})
    ckpt.add_written(write_rank_state(ckpt.tmp, "optimizer-tp000", {}))
    with pytest.raises(CheckpointError, match="written twice"):
        ckpt.add_written("optimizer-tp000.pt")
    ckpt.abort()
    assert latest_complete(run) is None


def test_incomplete_newer_dir_of_a_dead_writer_is_skipped_and_removed(run):
    _save(run, 10)
    tmp = run.checkpoints / f".tmp-step-00000020-{_dead_pid()}"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    assert latest_complete(run).step == 10
    (event,) = read_events(run, "checkpoint_skipped")
    assert event["checkpoint"] == tmp.name and event["step"] == 20
    assert event["reason"].startswith("incomplete: no manifest") and event["reason"].endswith("dead")
    assert not tmp.exists()


def test_temp_dir_of_a_live_writer_is_left_alone(run):
    _save(run, 10)
    tmp = run.checkpoints / f".tmp-step-00000020-{os.getppid()}"
    tmp.mkdir()
    assert latest_complete(run).step == 10
    assert tmp.exists() and read_events(run, "checkpoint_skipped")[0]["reason"].endswith("alive")


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.joinpath("model.safetensors").write_bytes(
        bytes(b ^ 0xFF if i == 20 else b for i, b in enumerate(p.joinpath("model.safetensors").read_bytes()))),
     "sha256 mismatch in model.safetensors"),
    (lambda p: p.joinpath("trainer.json").write_text("{}"), "size mismatch in trainer.json"),
    (lambda p: p.joinpath("trainer.json").unlink(), "missing file trainer.json"),
    (lambda p: p.joinpath("manifest.json").unlink(), "incomplete: no manifest.json"),
    (lambda p: p.joinpath("manifest.json").write_text("{not json"), "corrupt manifest.json"),
])
def test_damaged_newest_checkpoint_is_skipped_with_its_reason(run, damage, reason):
    _save(run, 10)
    newest = _save(run, 20).saved.path
    damage(newest)
    assert latest_complete(run).step == 10
    (event,) = read_events(run, "checkpoint_skipped")
    assert event["checkpoint"] == "step-00000020" and event["reason"].startswith(reason)
    assert not newest.exists() and (run.checkpoints / event["moved_to"]).is_dir()
    assert latest_complete(run).step == 10 and len(read_events(run, "checkpoint_skipped")) == 1
    with pytest.raises(CheckpointError, match=reason.split(" ")[0]):
        Checkpoint.open(run.checkpoints / event["moved_to"])


def test_without_tidy_nothing_is_moved(run):
    _save(run, 10)
    (_save(run, 20).saved.path / "trainer.json").write_text("{}")
    assert latest_complete(run, tidy=False).step == 10
    assert (run.checkpoints / "step-00000020").is_dir()


def test_retention_keeps_the_newest(run):
    for step in (1, 2, 3, 4):
        _save(run, step, keep=2)
    assert sorted(p.name for p in run.checkpoints.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert [p.name for p in prune(run, 1)] == ["step-00000003"]


def test_saving_a_step_again_replaces_it(run):
    _save(run, 7)
    with CheckpointWriter(run, 7) as ckpt:
        ckpt.save_json("trainer", {"again": True})
    assert latest_complete(run).load_json("trainer") == {"again": True}
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["latest", "step-00000007"]


@pytest.mark.parametrize("spec, paused", [("2", [0, 8, 16, 24]), ("2@16", [16, 24]), ("2@16-16", [16]),
                                          ("2@8-16", [8, 16])])
def test_the_pause_hook_picks_its_steps(monkeypatch, spec, paused):
    """RLSLURM_TEST_PAUSE_IN_CHECKPOINT_S: the window in which the cluster tests SIGKILL a writer."""
    import rlslurm.checkpoint as checkpoint

    slept = []
    monkeypatch.setenv(checkpoint.PAUSE_ENV, spec)
    monkeypatch.setattr(checkpoint.time, "sleep", slept.append)
    hit = []
    for step in (0, 8, 16, 24):
        before = len(slept)
        checkpoint._pause_for_test(step)
        if len(slept) > before:
            hit.append(step)
    assert hit == paused and set(slept) == {2.0}
