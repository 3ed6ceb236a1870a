"""The job's secret: one random token per run, in <run>/secret (mode 0600), that every server of the job
requires from its callers.

    path = ensure(run.secret)            # submit: created once; requeues and resumes of the run reuse it
    token = read(path)                   # a client: sent as `Authorization: Bearer <token>`
    python -m rlslurm.rollout.server --secret-file <run>/secret ...   # a server: the path, never the value

Servers are handed the file's path (argv `--secret-file`, or RLSLURM_SECRET_FILE naming it), never the
token itself: argv and the environment are what `ps`, /proc and the diag bundle's env capture show. An
OpenAI client passes the token as its `api_key` (it sends the same header). For a server started by
hand: `python -m rlslurm.secret PATH` makes a secret file there (if none) and prints its path.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import sys
from pathlib import Path

from rlslurm.errors import RunDirError

FILE_NAME = "secret"
ENV_VAR = "RLSLURM_SECRET_FILE"
"""Names the secret file of a server started without `--secret-file` (a path, not the secret)."""
TOKEN_BYTES = 32


def ensure(path: str | Path) -> Path:
    """Create a secret file at `path` unless one is there; returns the path. Atomic and owner-only: the
    token is written to a temporary file of mode 0600 first and linked into place, so a reader never sees
    a half-written file and two processes racing keep one token."""
    path = Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")  # one per writer
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask or a file left behind said
        os.write(fd, (secrets.token_urlsafe(TOKEN_BYTES) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process of the job was first: its token is the job's
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read(path: str | Path) -> str:
    """The token in a secret file; RunDirError if it is missing, empty, or readable by anyone but its owner."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise RunDirError(f"secret file {path}: {e.strerror or e} (rlslurm submit creates <run>/secret; "
                          f"`python -m rlslurm.secret {path}` makes one by hand)") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RunDirError(f"secret file {path} has mode {stat.S_IMODE(mode):o}: group or others may read it; "
                          f"chmod 600 {path}")
    if not text:
        raise RunDirError(f"secret file {path} is empty")
    return text


def from_env_or(path: str | Path | None) -> str:
    """The token of the secret file `path`, else of the file RLSLURM_SECRET_FILE names; RunDirError if neither."""
    path = path or os.environ.get(ENV_VAR)
    if not path:
        raise RunDirError(f"no secret file: pass --secret-file <run>/secret (or set {ENV_VAR} to its path); "
                          "every admin route of this server requires the job's secret")
    return read(path)


def matches(presented: str | None, token: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <token>`, compared in constant time."""
    if not presented:
        return False
    scheme, _, value = presented.partition(" ")
    # compare_digest on bytes: its time depends on the length only, not on where the strings differ.
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def bearer(token: str | None) -> dict[str, str]:
    """The header a client sends (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.executable} -m rlslurm.secret PATH")
    print(ensure(sys.argv[1]))
