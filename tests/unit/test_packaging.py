"""Packaging: every package folder is installed under `rlslurm`, and no bare `jobs`/`diag` module exists."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> tuple[set[str], dict[str, str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = data["tool"]["setuptools"]
    return set(tool["packages"]), tool["package-dir"]


def test_every_package_folder_is_listed_in_pyproject():
    packages, dirs = _declared()
    found = set()
    for top, name in (("rlslurm", "rlslurm"), ("jobs", "rlslurm.jobs"), ("diag", "rlslurm.diag")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    assert found <= packages, f"add to pyproject [tool.setuptools] packages: {sorted(found - packages)}"
    assert dirs["rlslurm.jobs"] == "jobs" and dirs["rlslurm.diag"] == "diag"
    assert not {p for p in packages if not p.startswith("rlslurm")}


def test_top_level_folders_exist():
    for folder in ("rlslurm", "jobs", "diag", "sbatch", "tests", "examples", "bench"):
        assert (ROOT / folder).is_dir(), folder
