"""What a failed checkpoint save says: one `checkpoint_failed` event with the error, its errno, a full disk told
apart, the free space, and the newest complete checkpoint that stays what resume takes.

    report_failure(run, step, tmp_dir, exc, attempt=(2, 3), then=writer.abort)   # rlslurm/checkpoint.py calls it

The free space is measured before `then` (the writer's abort) removes the temp dir: its partial files still hold
the space the write met; the event is written after it, into the space they gave back (a full disk has room for
it then). torch.save turns ENOSPC into a RuntimeError with no errno ("PytorchStreamWriter failed writing file"),
so a full disk is told by the errno where there is one, else by the space left.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Callable

from rlslurm import events
from rlslurm.rundir import RunDir

DISK_FULL_BYTES = 1 << 20
"""Free bytes under which a failed save is called a full disk when its error carries no errno (torch.save's)."""
LATEST = "latest"


def report_failure(run: RunDir, step: int, tmp: Path, exc: BaseException, *, attempt: tuple[int, int] | None = None,
                   then: Callable[[], object] | None = None) -> None:
    """Event `checkpoint_failed` for the save of `step` (temp dir `tmp`) that `exc` ended; `then` runs between the
    measure of the free space and the event. Best effort: the disk that failed the write may refuse the event."""
    code = next((e.errno for e in _chain(exc) if isinstance(e, OSError) and e.errno), None)
    try:
        stat = os.statvfs(tmp if tmp.exists() else run.checkpoints)
        free_bytes = stat.f_bavail * stat.f_frsize
    except OSError:
        free_bytes = None
    if then is not None:
        then()
    full = code in (errno.ENOSPC, errno.EDQUOT) or (free_bytes is not None and free_bytes < DISK_FULL_BYTES)
    latest = run.checkpoints / LATEST
    try:
        newest = latest.read_text().strip() if latest.is_file() else None
    except OSError:
        newest = None
    tried = {"attempt": attempt[0], "attempts": attempt[1]} if attempt else {}
    with contextlib.suppress(OSError):
        events.emit(run, events.CHECKPOINT_FAILED, step=step, checkpoint=tmp.name,
                    error=f"{type(exc).__name__}: {exc}"[:500], disk_full=full, free_bytes=free_bytes,
                    filesystem=str(run.checkpoints), errno=errno.errorcode.get(code) if code else None,
                    newest_complete=newest, **tried)


def _chain(exc: BaseException | None):
    """`exc` and the exceptions it was raised from or during."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
