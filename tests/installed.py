"""rlslurm as a user installs it, for every tier (tests/conftest.py puts this folder on sys.path): a wheel of this
checkout, installed NOT editable into a venv of its own, run from a directory outside the checkout.

    from installed import build_wheel, installed_venv
    wheel = build_wheel(tmp / "whl")                 # offline, from a copy of the sources (~3 s)
    venv = installed_venv(tmp / "venv", wheel)       # ~5 s: the wheel, and the dependencies this venv has
    venv.run(["rlslurm", "submit", ...], cwd=tmp / "elsewhere")

The venv reuses the dependencies already installed here (torch, transformers, ...: a `.pth` line names this
interpreter's site-packages, added after the venv's own) instead of downloading them: seconds, no network. That
directory holds the checkout's editable install too, but only as files a `.pth` there would activate, and a
`.pth` line adds a directory without reading the `.pth` files in it: the wheel's rlslurm is the one that imports,
and the checkout's top-level `jobs` and `diag` folders are nowhere on the path (`Venv.check` proves both).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("rlslurm", "jobs", "diag", "pyproject.toml", "README.md")
"""What the wheel is built from (pyproject.toml's package-dir maps jobs/ and diag/ under rlslurm)."""


def build_wheel(into: Path) -> Path:
    """rlslurm's wheel (`pip wheel --no-deps`), built offline from a copy of its sources, so the checkout gets no
    build/ or egg-info."""
    src = into.parent / "wheel-src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "-w", str(into), str(src)], check=True, timeout=300)
    (wheel,) = into.glob("rlslurm-*.whl")
    return wheel


@dataclass
class Venv:
    path: Path

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    def env(self) -> dict[str, str]:
        """This environment with the venv's bin first and nothing that would put the checkout on the path."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        return {**env, "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(self.path),
                "PYTHONNOUSERSITE": "1"}

    def run(self, argv: list[str], cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
        """`argv` (its first word found on the venv's bin first) in `cwd`; output captured."""
        return subprocess.run(argv, cwd=cwd, env=self.env(), capture_output=True, text=True, timeout=timeout_s)

    def check(self, cwd: Path) -> str:
        """Where rlslurm imports from in this venv (never the checkout), and that no bare `jobs`/`diag` exists."""
        probe = ("import importlib.util, rlslurm, rlslurm.jobs.sft, rlslurm.jobs.rl, rlslurm.diag.watchdog\n"
                 "print(rlslurm.__file__)\n"
                 "print(importlib.util.find_spec('jobs'), importlib.util.find_spec('diag'))\n")
        done = self.run([str(self.bin / "python"), "-c", probe], cwd=cwd, timeout_s=120)
        assert done.returncode == 0, done.stdout + done.stderr
        where, bare = done.stdout.splitlines()
        assert where.startswith(str(self.path)) and not where.startswith(str(ROOT)), where
        assert bare == "None None", f"a bare jobs/diag module is importable: {bare}"
        return where


def installed_venv(path: Path, wheel: Path) -> Venv:
    """A venv at `path` with `wheel` installed (not editable) and this interpreter's dependencies reused."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    venv = Venv(path)
    subprocess.run([str(venv.bin / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=300, env=venv.env())
    # After the install: pip would otherwise see the checkout's editable rlslurm there and try to replace it.
    site = Path(subprocess.run([str(venv.bin / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv
