"""Atomic checkpoints: temp dir, fsync, manifest (sizes + checksums), rename, `latest` pointer.

A checkpoint is complete only once its manifest is written and its directory renamed into place:

    checkpoints/.tmp-step-00000012-<pid>/   files written and fsynced, manifest.json last
    checkpoints/step-00000012/              after rename(2) + fsync of checkpoints/
    checkpoints/latest                      "step-00000012", replaced atomically (tmp file + rename)

Writing (one writer per run directory at a time: rank 0 of the running job):

    with CheckpointWriter(run, step=12, policy_version=3) as ckpt:
        ckpt.save_tensors("model", model.state_dict())      # model.safetensors, HF names
        ckpt.save_state("optimizer", optimizer.state_dict())  # optimizer.pt via torch.save
        ckpt.save_json("trainer", {"data_position": 96})     # trainer.json
    ckpt.saved.seconds, ckpt.saved.bytes                      # C, measured; also a checkpoint_saved event

State sharded over ranks (Megatron's distributed optimizer) is written by its owners straight into the
writer's temp dir, `write_rank_state(ckpt.tmp, "optimizer-tp001", shard)` on each owning rank; rank 0
then lists each file with `ckpt.add_written(filename)` before the commit, so the manifest covers it.

Reading: `latest_complete(run)` returns the newest checkpoint whose manifest sizes and sha256 match the
files; newer incomplete (`.tmp-*`, no manifest) or corrupt ones are skipped with a `checkpoint_skipped`
event naming the reason. Corrupt ones are renamed `step-XXXXXXXX.corrupt-<time>` (kept for diag, never
picked again); temp dirs of dead writers are removed.

When to save: `IntervalPolicy` (end of this module). `checkpoint:` in a job YAML is `CheckpointConfig`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from rlslurm import events
from rlslurm.checkpoint_failure import report_failure
from rlslurm.configfile import check_range
from rlslurm.durable import fsync
from rlslurm.errors import CheckpointError
from rlslurm.node import node_name
from rlslurm.plan.checkpoint_interval import checkpoint_interval
from rlslurm.rundir import RunDir

if TYPE_CHECKING:
    import torch

# torch and safetensors are imported where tensors are written or read: CheckpointConfig is part of every job
# config, and `rlslurm validate` / `plan` must not wait ~3 s for torch to load.

MANIFEST = "manifest.json"
LATEST = "latest"
PAUSE_ENV = "RLSLURM_TEST_PAUSE_IN_CHECKPOINT_S"
"""Test hook: `S`, `S@STEP` or `S@FIRST-LAST` pauses S seconds after the first file of a save (of a step
>= STEP, or in FIRST..LAST), so a test can SIGKILL the writer while the checkpoint is half written."""

_COMPLETE = re.compile(r"^step-(\d{8})$")
_TMP = re.compile(r"^\.tmp-step-(\d{8})-(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    interval_steps: int | None = None
    """Steps between periodic checkpoints; null = Young/Daly from the measured cost and mtbf_h. Range [1, 1e8]."""
    cost_s: float = 60.0
    """Seconds one checkpoint costs, until measured (C in Young/Daly; the lecture's is 490 s). A drain on the
    pre-timeout signal must fit one step and C in cluster.signal_before_s (90 s by default): the lecture's C
    as a default would lose every drain checkpoint of a job that does not set it. Range [0, 1000000]."""
    mtbf_h: float = 24.0
    """Mean time between failures of the whole job, in hours (M in Young/Daly). Range (0, 1000000]."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted after a newer one is complete. Range [1, 1000]."""
    max_no_progress_restarts: int = 3
    """Restarts in a row that make no step of progress before the job stops requeueing itself. Range [1, 1000]."""
    kill_wait_s: float = 30.0
    """Seconds SLURM leaves between SIGTERM and SIGKILL (its KillWait); a drain on SIGTERM saves only if C fits.
    Range [0, 86400]."""
    save_attempts: int = 3
    """Tries of one periodic save before it is skipped (a storage fault: unwritable, full, a hiccup); each failed
    try is a `checkpoint_failed` event. Range [1, 100]."""
    retry_backoff_s: float = 2.0
    """Seconds before the second try of a save, doubled before each further one (2, 4, ...). Range [0, 3600]."""
    max_failed_saves: int = 3
    """Saves in a row that may be skipped after all their tries (`checkpoint_save_skipped`; training goes on, the
    newest complete checkpoint stays `latest`); the next one that fails stops the job, naming the error. A save
    is tried again at the next interval, not at the next step. Range [0, 1000]."""

    def __post_init__(self):
        check_range(self.interval_steps, "interval_steps", 1, 10**8)
        check_range(self.cost_s, "cost_s", 0, 1_000_000, note="seconds")
        check_range(self.mtbf_h, "mtbf_h", 0, 1_000_000, low_open=True, note="hours")
        for key in ("keep", "max_no_progress_restarts"):
            check_range(getattr(self, key), key, 1, 1000)
        check_range(self.kill_wait_s, "kill_wait_s", 0, 86_400, note="seconds")
        check_range(self.save_attempts, "save_attempts", 1, 100)
        check_range(self.retry_backoff_s, "retry_backoff_s", 0, 3600, note="seconds")
        check_range(self.max_failed_saves, "max_failed_saves", 0, 1000)

    def retry_delays_s(self) -> list[float]:
        """The wait before each try of a save after the first: retry_backoff_s, doubled each time."""
        return [self.retry_backoff_s * 2 ** i for i in range(self.save_attempts - 1)]


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _pause_for_test(step: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    seconds, _, steps = spec.partition("@")
    first, _, last = steps.partition("-")
    if int(first or 0) <= step <= (int(last) if last else step):
        time.sleep(float(seconds))  # test hook only: the process is meant to be killed in here


@dataclass(frozen=True)
class SavedCheckpoint:
    """What one save wrote and what it cost (C of the interval policy)."""

    path: Path
    step: int
    seconds: float
    bytes: int


class CheckpointWriter:
    """Writes one checkpoint into a temp dir; `commit()` (or leaving the `with` block) makes it complete."""

    def __init__(self, run: RunDir, step: int, *, policy_version: int = 0, metadata: dict | None = None,
                 keep: int | None = None, clock=time.monotonic, attempt: tuple[int, int] | None = None):
        self.run, self.step, self.policy_version = run, step, policy_version
        self.metadata = dict(metadata or {})
        self.keep, self.clock = keep, clock
        self.attempt = attempt  # (this try, of how many): said in a checkpoint_failed event
        self.saved: SavedCheckpoint | None = None
        self._started = clock()
        self._files: dict[str, dict] = {}
        self.tmp = run.checkpoints / f".tmp-{step_dirname(step)}-{os.getpid()}"
        try:
            run.checkpoints.mkdir(parents=True, exist_ok=True)
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
        except OSError as e:
            # The temp dir is the first write of a save: an unwritable or full checkpoints directory fails here,
            # before any `with` block could report it (issue 38: no checkpoint_failed event was ever written).
            self._report_failure(e)
            raise CheckpointError(f"checkpoint of step {step}: cannot create {self.tmp}: "
                                  f"{type(e).__name__}: {e}") from e

    def _add(self, filename: str, path: Path) -> None:
        fsync(path)
        self._files[filename] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        if len(self._files) == 1:
            _pause_for_test(self.step)

    def _path(self, name: str, suffix: str) -> tuple[str, Path]:
        if not _NAME.match(name) or name == "manifest":
            raise CheckpointError(f"checkpoint file name {name!r} must match {_NAME.pattern} and not be 'manifest'")
        filename = name + suffix
        if filename in self._files:
            raise CheckpointError(f"checkpoint {self.tmp.name}: {filename} written twice")
        return filename, self.tmp / filename

    def add_written(self, filename: str) -> None:
        """A file another rank wrote into `self.tmp` (`write_rank_state`): fsynced, sized and hashed here."""
        path = self.tmp / filename
        if filename in self._files:
            raise CheckpointError(f"checkpoint {self.tmp.name}: {filename} written twice")
        if Path(filename).name != filename or not path.is_file():
            raise CheckpointError(f"checkpoint {self.tmp.name}: {filename!r} was not written into {self.tmp}")
        self._add(filename, path)

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        """Tensors (model weights under their Hugging Face names) as `<name>.safetensors`."""
        filename, path = self._path(name, ".safetensors")
        import safetensors.torch

        flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        safetensors.torch.save_file(flat, str(path), metadata=metadata)
        self._add(filename, path)

    def save_state(self, name: str, obj: Any) -> None:
        """Any picklable state (optimizer state dict, RNG states, RL buffers) as `<name>.pt` via torch.save."""
        import torch

        filename, path = self._path(name, ".pt")
        with open(path, "wb") as f:
            torch.save(obj, f)
        self._add(filename, path)

    def save_json(self, name: str, obj: Any) -> None:
        """Small JSON state (data position, counters) as `<name>.json`."""
        filename, path = self._path(name, ".json")
        path.write_text(json.dumps(obj, indent=1, sort_keys=True))
        self._add(filename, path)

    def commit(self) -> SavedCheckpoint:
        """Manifest last, rename into place, fsync the parent, move `latest`, prune, emit checkpoint_saved."""
        manifest = {
            "format": 1, "step": self.step, "policy_version": self.policy_version, "time": time.time(),
            "writer": {"host": node_name(), "pid": os.getpid()},
            "files": self._files, "metadata": self.metadata,
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        fsync(self.tmp / MANIFEST)
        fsync(self.tmp)
        final = self.run.checkpoints / step_dirname(self.step)
        replaced = None
        if final.exists():  # the same step saved again (a drain right after a periodic save): swap it
            replaced = final.with_name(f".replaced-{final.name}-{os.getpid()}")
            os.rename(final, replaced)
        os.rename(self.tmp, final)
        fsync(self.run.checkpoints)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        _write_latest(self.run, final.name)
        size = sum(f["bytes"] for f in self._files.values())
        self.saved = SavedCheckpoint(final, self.step, self.clock() - self._started, size)
        events.emit(self.run, events.CHECKPOINT_SAVED, step=self.step, checkpoint=final.name,
                    seconds=round(self.saved.seconds, 6), bytes=size)
        if self.keep is not None:
            prune(self.run, self.keep)
        return self.saved

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except Exception as e:  # the manifest, the rename or `latest`: the same storage, the same report
                self._report_failure(e, then=self.abort)
                raise
        elif isinstance(exc, Exception):
            self._report_failure(exc, then=self.abort)
        else:
            self.abort()

    def _report_failure(self, exc: Exception, then=None) -> None:
        report_failure(self.run, self.step, self.tmp, exc, attempt=self.attempt, then=then)


def write_rank_state(directory: Path, name: str, obj: Any) -> str:
    """This rank's share of a sharded state as `<name>.pt` in a writer's temp dir (fsynced); returns the
    file name for rank 0's `CheckpointWriter.add_written`."""
    if not _NAME.match(name) or name == "manifest":
        raise CheckpointError(f"checkpoint file name {name!r} must match {_NAME.pattern} and not be 'manifest'")
    import torch

    path = Path(directory) / f"{name}.pt"
    with open(path, "wb") as f:
        torch.save(obj, f)
    fsync(path)
    return path.name


def _write_latest(run: RunDir, name: str) -> None:
    tmp = run.checkpoints / f".{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(name + "\n")
    fsync(tmp)
    os.replace(tmp, run.checkpoints / LATEST)
    fsync(run.checkpoints)


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint on disk, opened for reading."""

    path: Path
    manifest: dict

    step = property(lambda self: int(self.manifest["step"]))
    policy_version = property(lambda self: int(self.manifest.get("policy_version", 0)))
    name = property(lambda self: self.path.name)

    @classmethod
    def open(cls, path: Path, *, verify: bool = True) -> "Checkpoint":
        """Read the manifest (and check every file against it); raises CheckpointError saying what is wrong."""
        reason = problem(path, deep=verify)
        if reason:
            raise CheckpointError(f"checkpoint {path} is not usable: {reason}")
        return cls(path, json.loads((path / MANIFEST).read_text()))

    def _file(self, filename: str) -> Path:
        if filename not in self.manifest["files"]:
            raise CheckpointError(f"checkpoint {self.path} has no {filename}; it has {sorted(self.manifest['files'])}")
        return self.path / filename

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        import safetensors.torch

        return safetensors.torch.load_file(str(self._file(name + ".safetensors")))

    def has_state(self, name: str) -> bool:
        return f"{name}.pt" in self.manifest["files"]

    def load_state(self, name: str) -> Any:
        import torch

        # Our own file, checked against the manifest's sha256: full unpickling (numpy RNG state) is safe here.
        return torch.load(self._file(name + ".pt"), weights_only=False)

    def load_json(self, name: str) -> Any:
        return json.loads(self._file(name + ".json").read_text())


def problem(path: Path, *, deep: bool = True) -> str | None:
    """Why the checkpoint at `path` is not complete and intact, or None. `deep` hashes every file."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        int(manifest["step"])
    except FileNotFoundError:
        return "incomplete: no manifest.json"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"corrupt manifest.json ({type(e).__name__}: {e})"
    for filename, facts in sorted(files.items()):
        f = path / filename
        if not f.is_file():
            return f"missing file {filename}"
        size = f.stat().st_size
        if size != facts["bytes"]:
            return f"size mismatch in {filename}: {size} bytes on disk, manifest says {facts['bytes']}"
        if deep and _sha256(f) != facts["sha256"]:
            return f"sha256 mismatch in {filename}"
    return None


def _scan(run: RunDir) -> list[tuple[int, Path, int | None]]:
    """(step, path, writer pid or None for a renamed dir), newest step first."""
    if not run.checkpoints.is_dir():
        return []
    found = []
    for p in run.checkpoints.iterdir():
        if m := _COMPLETE.match(p.name):
            found.append((int(m.group(1)), p, None))
        elif m := _TMP.match(p.name):
            found.append((int(m.group(1)), p, int(m.group(2))))
    return sorted(found, key=lambda x: (x[0], x[2] is None), reverse=True)


def _writer_alive(pid: int) -> bool:
    # One writer per run directory at a time (rank 0 of the running job), so a temp dir whose pid is not
    # alive on this host was left by a writer of an earlier start. A reused pid only delays the cleanup.
    return pid != os.getpid() and psutil.pid_exists(pid)


@dataclass(frozen=True)
class Survey:
    """What a resume would start from: the newest complete, verified checkpoint, and the newer ones skipped."""

    chosen: Checkpoint | None
    skipped: list[dict]
    """Newer checkpoints skipped, newest first: `step`, `checkpoint` (name), `reason`; a complete-looking but
    damaged one also `moved_to` (where `tidy` renamed it; its own name without)."""


def survey(run: RunDir, *, tidy: bool = False) -> Survey:
    """The newest complete, verified checkpoint of `run` and the newer broken ones, without events.

    With `tidy`, corrupt ones are renamed aside and temp dirs of dead writers removed (the sole writer does this).
    """
    chosen: Checkpoint | None = None
    skipped: list[dict] = []
    for step, path, pid in _scan(run):
        if pid is not None:
            alive = _writer_alive(pid)
            if chosen is None:
                skipped.append({"step": step, "checkpoint": path.name,
                                "reason": f"incomplete: no manifest, writer pid {pid} {'alive' if alive else 'dead'}"})
            if tidy and not alive:
                shutil.rmtree(path, ignore_errors=True)
            continue
        if chosen is not None:
            continue
        reason = problem(path)
        if reason is None:
            chosen = Checkpoint(path, json.loads((path / MANIFEST).read_text()))
            continue
        moved = path
        if tidy:
            moved = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            os.rename(path, moved)
        skipped.append({"step": step, "checkpoint": path.name, "reason": reason, "moved_to": moved.name})
    return Survey(chosen, skipped)


def latest_complete(run: RunDir, *, tidy: bool = True) -> Checkpoint | None:
    """The newest complete, verified checkpoint of `run`, or None; newer broken ones are skipped with an event.

    With `tidy`, corrupt ones are renamed aside and temp dirs of dead writers removed (the sole writer calls this).
    """
    found = survey(run, tidy=tidy)
    for skip in found.skipped:
        events.emit(run, events.CHECKPOINT_SKIPPED, **skip)
    return found.chosen


def prune(run: RunDir, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep`; returns what was deleted."""
    complete = [path for _, path, pid in _scan(run) if pid is None]
    doomed = complete[keep:]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


class IntervalPolicy:
    """When to save: every `interval_steps` if configured, else Young/Daly steps from the measured cost C.

    C starts at `checkpoint.cost_s` and follows each measured save; the step time follows each measured
    step. The interval is capped at the allocation's time limit minus C, and once the rest of the
    allocation holds only one more step and a save, a save is due if none landed in this allocation yet:
    a requeue never loses a whole allocation. Before the first measured step no Young/Daly save is due.
    """

    def __init__(self, config: CheckpointConfig, *, time_limit_s: float | None = None, start_step: int = 0,
                 clock=time.monotonic):
        self.config, self.time_limit_s, self.clock = config, time_limit_s, clock
        self.cost_s = config.cost_s
        self.step_s: float | None = None
        self._allocation_start = clock()
        self._last_saved_step = start_step
        self._saved_in_allocation = False

    def observe_step(self, seconds: float) -> None:
        # A moving average: one slow step (first-touch allocation, a GC) should not swing the interval.
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def observe_save(self, step: int, seconds: float) -> None:
        self.cost_s = seconds
        self._last_saved_step = step
        self._saved_in_allocation = True

    def observe_failed_save(self, step: int) -> None:
        """A save at `step` was skipped after all its tries: the next one is due an interval later, not at the
        next step (a storage fault is met once per interval; checkpoint.max_failed_saves bounds how many)."""
        self._last_saved_step = step

    def interval_steps(self) -> int | None:
        """Steps between saves now; None while no step time is known (Young/Daly needs it)."""
        cap_s = None if self.time_limit_s is None else max(self.time_limit_s - self.cost_s, 0.0)
        if self.config.interval_steps is not None:
            if cap_s is None or not self.step_s:
                return self.config.interval_steps
            return max(1, min(self.config.interval_steps, int(cap_s // self.step_s)))
        if not self.step_s:
            return None
        return checkpoint_interval(self.cost_s, self.config.mtbf_h * 3600.0, self.step_s, cap_s).daly_steps

    def remaining_s(self) -> float | None:
        """Seconds left in this allocation by its time limit, or None when there is none."""
        if self.time_limit_s is None:
            return None
        return self.time_limit_s - (self.clock() - self._allocation_start)

    def due(self, step: int) -> bool:
        """Whether to save after finishing `step`."""
        if step <= self._last_saved_step:
            return False
        interval = self.interval_steps()
        if interval is not None and step - self._last_saved_step >= interval:
            return True
        remaining = self.remaining_s()
        if remaining is not None and not self._saved_in_allocation:
            return remaining < (self.step_s or 0.0) + self.cost_s
        return False
