"""Storage faults while the RL job checkpoints (rlslurm/rl/checkpointing.py), on two real gloo ranks, issue 38:
a save that fails is tried again with backoff, then skipped (training goes on, the newest complete checkpoint
stays `latest`), each failed try is a `checkpoint_failed` event naming the error, and past
checkpoint.max_failed_saves skipped saves in a row every rank stops at once, naming it, none left waiting in a
collective. Before, the temp dir's mkdir ran before any failure path: no event, no retry, rank 0 raised and rank 1
waited in the broadcast until gloo said "Connection closed by peer".

The storage fault is real: the checkpoints directory is a plain file while it "fails" (mkdir meets
FileExistsError, as it meets EROFS on a read-only mount: tests/cluster/test_recovery_slurm.py), and a rank's
optimizer shard (the Megatron layout, a sharded optimizer of the test's own) fails to write once."""

from __future__ import annotations

import dataclasses
import datetime
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from procs import spawn_ranks
from rlslurm import events
from rlslurm.checkpoint import CheckpointConfig, latest_complete, write_rank_state
from rlslurm.config import JobConfig
from rlslurm.dist import Topology, free_port
from rlslurm.errors import CheckpointError
from rlslurm.rl.checkpointing import CheckpointSaves, save
from rlslurm.rundir import RunDir


class _Optimizer:
    """A sharded optimizer's checkpoint side: each rank writes its shard; rank 1's first write fails."""

    def __init__(self, rank: int, fail_first: bool):
        self.rank, self.fail_first, self.writes = rank, fail_first, 0

    def state_dict(self) -> dict:
        return {"step": 3}

    def save_shards(self, directory: Path) -> list[str]:
        self.writes += 1
        if self.fail_first and self.writes == 1:
            raise OSError(5, "Input/output error")  # what a flaky shared filesystem says
        return [write_rank_state(directory, f"optimizer-rank{self.rank:03d}", {"m": torch.ones(2) * self.rank})]


class _Policy:
    def __init__(self, rank: int, fail_first: bool = False):
        self.optimizer = _Optimizer(rank, fail_first)

    def weights(self) -> dict:
        return {"w": torch.arange(4.0)}


def _job(**checkpoint) -> JobConfig:
    job = JobConfig()
    return dataclasses.replace(job, checkpoint=CheckpointConfig(**{"retry_backoff_s": 0.01, **checkpoint}))


def _init(rank: int, port: int) -> Topology:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    return Topology(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port)


def _unwritable_then_back(rank: int, port: int, run_dir: str, out: dict) -> None:
    """Step 2 saves; then the checkpoints directory is a file for the first 2 tries of step 4's save and a
    rank's shard fails its first write at step 6: both saved in the end."""
    topo = _init(rank, port)
    run = RunDir(Path(run_dir))
    job = _job(save_attempts=3)
    out_rank = {"step2": save(run, job, topo, _Policy(rank), 2, 2, {})}
    dist.barrier()
    if rank == 0:
        shutil.move(run.checkpoints, run.path / "checkpoints.away")
        run.checkpoints.write_text("not a directory: the storage refuses every write here\n")
    sleeps = []

    def sleep(seconds: float) -> None:  # the backoff; the storage comes back before the third try
        sleeps.append(seconds)
        if rank == 0 and len(sleeps) == 2:
            run.checkpoints.unlink()
            shutil.move(run.path / "checkpoints.away", run.checkpoints)
        dist.barrier()

    out_rank["step4"] = save(run, job, topo, _Policy(rank), 4, 4, {}, sleep=sleep)
    out_rank["sleeps"] = sleeps
    out_rank["step6"] = save(run, job, topo, _Policy(rank, fail_first=rank == 1), 6, 6, {}, sleep=lambda s: None)
    out[rank] = out_rank
    dist.destroy_process_group()


def test_a_failed_save_is_tried_again_with_backoff_and_written_once_the_storage_is_back(tmp_path):
    run = RunDir(tmp_path / "run").create()
    result = spawn_ranks(_unwritable_then_back, (free_port(), str(run.path)))
    for rank in (0, 1):  # every rank learns rank 0's outcome of every try
        assert result[rank]["step2"] is not None and result[rank]["step4"] is not None, result[rank]
        assert result[rank]["step6"] is not None and result[rank]["sleeps"] == [0.01, 0.02]
    failed = events.read_events(run, events.CHECKPOINT_FAILED)
    assert [(e["step"], e["attempt"], e["attempts"]) for e in failed] == [(4, 1, 3), (4, 2, 3), (6, 1, 3)]
    # The whole directory refused (a file in its place): not even `latest` could be read then.
    assert [e["newest_complete"] for e in failed[:2]] == [None, None], failed
    assert "FileExistsError" in failed[0]["error"] and failed[0]["errno"] == "EEXIST", failed[0]
    assert "optimizer shards not written: rank 1: OSError: [Errno 5] Input/output error" in failed[2]["error"]
    assert failed[2]["newest_complete"] == "step-00000004"
    assert latest_complete(run).step == 6 and sorted(latest_complete(run).manifest["files"]) == [
        "model.safetensors", "optimizer-rank000.pt", "optimizer-rank001.pt", "optimizer.pt", "rl_state.json", "rng.pt"]
    assert not list(run.checkpoints.glob(".tmp-*"))  # the failed tries' temp dirs are gone


def _never_writable(rank: int, port: int, run_dir: str, out: dict) -> None:
    """A save at step 2, then the storage refuses every write: saves at 3 and 4 are skipped (max 2 in a row),
    the third skip in a row (5) stops both ranks at the same step."""
    topo = _init(rank, port)
    run = RunDir(Path(run_dir))
    job = _job(save_attempts=2, max_failed_saves=2)
    saves = CheckpointSaves(run, job, topo, sleep=lambda s: None)
    seen = [saves.save(_Policy(rank), 2, 2, {})]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(run.checkpoints)
        run.checkpoints.write_text("full\n")
    dist.barrier()
    stopped = None
    for step in (3, 4, 5, 6):
        try:
            seen.append(saves.save(_Policy(rank), step, step, {}))
        except CheckpointError as e:
            stopped = (step, str(e))
            break
    out[rank] = {"seen": seen, "stopped": stopped}
    dist.destroy_process_group()


def test_saves_skipped_past_the_bound_stop_every_rank_at_the_same_step_naming_the_error(tmp_path):
    run = RunDir(tmp_path / "run").create()
    result = spawn_ranks(_never_writable, (free_port(), str(run.path)))
    for rank in (0, 1):
        seen, (step, said) = result[rank]["seen"], result[rank]["stopped"]
        assert seen[0] is not None and seen[1:] == [None, None], seen  # saved, then skipped twice: trained on
        assert step == 5, (rank, step)
        assert "3 saves in a row failed all of their 2 tries (checkpoint.max_failed_saves = 2)" in said
        assert "Fix the storage of" in said and "rlslurm resume" in said
    skipped = events.read_events(run, events.CHECKPOINT_SAVE_SKIPPED)
    assert [(e["step"], e["failed_saves"], e["stopping"]) for e in skipped] == [(3, 1, False), (4, 2, False),
                                                                                (5, 3, True)]
    assert all("FileExistsError" in e["error"] for e in skipped), skipped
    assert len(events.read_events(run, events.CHECKPOINT_FAILED)) == 6  # 3 saves x 2 tries, each named
