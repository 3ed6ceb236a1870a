"""Durable files: fsync of a file or a directory, the step that makes a write-then-rename survive a crash.

    from rlslurm.durable import fsync
    fsync(tmp / "model.safetensors")   # the bytes are on disk
    os.rename(tmp, final)
    fsync(final.parent)                # and so is the rename

Used where a crash must never leave something a later start would trust half-written: checkpoints
(rlslurm/checkpoint.py) and model exports (rlslurm/tinymodel.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: str | Path) -> None:
    """Flush `path` (a file, or a directory: its entries, i.e. the renames into it) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
