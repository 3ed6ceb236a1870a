"""The engines rank 0 spawns, started first thing in the rank, so their start overlaps the trainer's own.

    early.start_engines(job, run, rank)                    # jobs/entry.py: first thing, before torch
    engines = early.take_engines(job, layout, run, model_dir)   # the Controller: those, or started now
    early.abandon()                                        # the rank ends: engines never taken are stopped

An engine server is a process of its own that imports torch and transformers and loads the model (~2-5 s on
2 cores). Started by the Controller, it began only once the trainer had imported torch and transformers, formed
its process group and loaded the policy, and the first step waited for both in turn (issue 36: 10-15 s from the
rank's start to its first step; TRL 3-4 s). Started here, from a thread of rank 0, it loads while the trainer does.

Only where rank 0 spawns the engines (off SLURM, or colocated on it) and their model is on disk before the trainer
writes anything: train.init_from (an SFT export), or a previous start's random init. Elsewhere the Controller
starts them as before. The thread ends once the engines answer (or failed to: the error is raised by
`take_engines`, in the Controller, as it was raised there before). Lifecycle: `start_engines` once per process;
`take_engines` hands them over (the Controller stops them with itself); `abandon` stops any not handed over.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from rlslurm.layout import JobLayout
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)

_started: dict[str, tuple[threading.Thread, dict]] = {}
"""Model directory -> the thread starting engines for it, and its result box {engines | error}."""


def _model_dir(job, run: RunDir) -> Path:
    """The weights the engines start from: what rlslurm/rl/loop.py's initial_model_dir hands the Controller."""
    return Path(job.train.init_from) if job.train.init_from else run.path / "export" / "init"


def start_engines(job, run: RunDir, rank: int) -> bool:
    """On rank 0 (`rank`: this trainer rank's) of an RL job whose engines it spawns and whose model is on disk: start
    them in a thread now. True when started."""
    if job.job.kind != "rl" or rank != 0:
        return False
    layout = JobLayout.read(run)
    model_dir = _model_dir(job, run)
    if layout.engines_from_component or not (model_dir / "config.json").is_file():
        return False
    # Imported here, not in the thread: the thread then imports nothing while this one goes on to import torch (two
    # threads importing the same modules at once wait on each other's import locks). No torch among them.
    import rlslurm.rollout.client  # noqa: F401
    import rlslurm.rollout.supervisor  # noqa: F401
    from rlslurm.rl.engines import Engines

    box: dict = {}

    def start() -> None:
        try:
            box["engines"] = Engines(job, layout, run, model_dir)
        except BaseException as e:  # noqa: B036 - handed to the Controller's thread, which raises it
            box["error"] = e

    thread = threading.Thread(target=start, name="early-engines", daemon=True)
    thread.start()
    _started[str(model_dir.resolve())] = (thread, box)
    log.info("starting %d engine(s) from %s beside the trainer's own start", layout.engines, model_dir)
    return True


def take_engines(job, layout: JobLayout, run: RunDir, model_dir: Path):
    """The engines `start_engines` started for `model_dir` (waited for; their start's error raised here), or, where
    none were, rlslurm/rl/engines.py's Engines started now."""
    from rlslurm.rl.engines import Engines

    started = _started.pop(str(Path(model_dir).resolve()), None)
    if started is None:
        return Engines(job, layout, run, model_dir)
    thread, box = started
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["engines"]


def abandon() -> None:
    """Stop the engines started here that no Controller took (the rank failed before it made one)."""
    while _started:
        _, (thread, box) = _started.popitem()
        thread.join()
        if "engines" in box:
            box["engines"].stop()
