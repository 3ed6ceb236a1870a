"""Files the CLI writes where a user points it (`rlslurm init -o`, `score --out`, the diag bundle, HumanEval's
jsonl): created anew, or replaced by a rename; never written through a symbolic link.

    write_file("job.yaml", text)                      # OutputFileError if anything is there, a dangling link too
    write_file("job.yaml", text, replace=True)        # --force: a new file renamed over the name
    with replacing(path) as f: ...                    # a stream (a tar.gz), renamed into place when it closes

Why: a plain open(path, "w") follows a link planted at the name, so `rlslurm init -o job.yaml` in a shared
directory wrote wherever a `job.yaml -> ~/.bashrc` pointed (a dangling link too: `exists()` says False), and
`--force` wrote through any link. O_CREAT | O_EXCL | O_NOFOLLOW creates a file only where nothing is, and a
rename replaces the name itself (the link), never what it points to.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import BinaryIO, Iterator

from rlslurm.errors import OutputFileError

NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _what(path: Path) -> str:
    if path.is_symlink():
        return f"a symbolic link (to {os.readlink(path)})" + ("" if path.exists() else ", dangling")
    return "a directory" if path.is_dir() else "a file"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_file(path: str | Path, data: str | bytes, *, replace: bool = False, mode: int = 0o644) -> Path:
    """Write `data` at `path`: a new file (OutputFileError when anything is there, a dangling link included),
    or with `replace`, a new file renamed over whatever file or link is there."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    if replace:
        with replacing(path, mode=mode) as f:
            f.write(payload)
        return path
    try:
        fd = os.open(path, NEW, mode)
    except FileExistsError:
        raise OutputFileError(f"{path}: {_what(path)} is already there; pass --force to replace it (a link is "
                              "replaced, never written through)") from None
    try:
        _write_all(fd, payload)
    finally:
        os.close(fd)
    return path


@contextlib.contextmanager
def replacing(path: str | Path, *, mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary file beside `path` (created new, O_NOFOLLOW), renamed over `path` when the block ends without an
    error (the name is replaced, a link there included; a directory there is an OutputFileError), removed if not."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise OutputFileError(f"{path}: a directory is there; name a file")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, NEW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
