"""The package's import graph (issue 39), read from the source with `ast`: every import of every module, the lazy
ones inside functions too (a type-only `if TYPE_CHECKING:` import runs nothing and is left out). No cycle; no
module imports the checkout's `jobs` or `diag` by those bare names (they install as rlslurm.jobs / rlslurm.diag);
every module has a floor in docs/architecture.md, and an import that climbs one carries `# upward: <why>` and is
listed there.

    python -m pytest -q -s tests/unit/test_import_graph.py      # -s prints the upward imports and their reasons
"""

from __future__ import annotations

import ast
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"rlslurm": "rlslurm", "rlslurm.jobs": "jobs", "rlslurm.diag": "diag"}
"""Dotted package -> its folder in the checkout (pyproject.toml's package-dir)."""
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module's path, relative to the checkout."""
    target: str
    """The imported module's path (a name imported from a module counts as that module)."""
    line: int
    reason: str | None
    """The `# upward: <why>` comment at the import (its lines, or the line above), if any."""


def modules(root: Path = ROOT) -> dict[str, str]:
    """Dotted module name -> its path relative to `root`, for every module of the package."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            name = ".".join((package, *(p for p in parts if p != "__init__")))
            if package == "rlslurm" and parts[0] in ("jobs", "diag"):
                continue
            out[name] = str(path.relative_to(root))
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST):
    """Every import statement of `tree`, outside `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            yield from (n for child in node.orelse for n in _statements_of(child))
            continue
        yield from _statements_of(node)


def _statements_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _statements(node)


def imports(root: Path = ROOT) -> tuple[list[Import], list[str]]:
    """(every import between the package's modules, every bare `jobs`/`diag` import as 'path:line')."""
    names = modules(root)
    by_path = {path: name for name, path in names.items()}
    found, bare = [], []

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in names:
            dotted = dotted.rpartition(".")[0]
        return names.get(dotted)

    for path, name in by_path.items():
        text = (root / path).read_text()
        lines = text.splitlines()
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in _statements(ast.parse(text)):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            comment = "\n".join(lines[max(node.lineno - 2, 0):node.end_lineno])
            reason = re.search(r"# upward: (.+?)(?:$|\n)", comment)
            for dotted in wanted:
                if dotted.split(".")[0] in ("jobs", "diag"):
                    bare.append(f"{path}:{node.lineno}")
                target = resolve(dotted) if dotted.startswith("rlslurm") else None
                if target is not None and target != path:
                    found.append(Import(path, target, node.lineno, reason.group(1).strip() if reason else None))
    return found, bare


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph `edges` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _fenced(name: str) -> list[str]:
    text = ARCHITECTURE.read_text()
    body = re.search(rf"^```{name}\n(.*?)^```", text, re.M | re.S)
    assert body, f"docs/architecture.md has no ```{name} block"
    return body.group(1).splitlines()


def floors() -> list[tuple[int, str]]:
    """(floor, path pattern) of docs/architecture.md's floors block."""
    out, floor = [], None
    for line in _fenced("floors"):
        head = re.match(r"floor (\d+)\s", line)
        if head:
            floor = int(head.group(1))
        elif line.strip():
            out += [(floor, pattern) for pattern in line.split()]
    return out


def floor_of(path: str, table: list[tuple[int, str]]) -> int | None:
    """The floor of the most specific (longest) pattern matching `path`."""
    matches = [(len(pattern), floor) for floor, pattern in table if fnmatch.fnmatch(path, pattern)]
    return max(matches)[1] if matches else None


def listed_upward() -> dict[tuple[str, str], str]:
    out = {}
    for line in _fenced("upward"):
        found = re.match(r"(\S+) -> (\S+): (.+)", line)
        if found:
            out[found.group(1), found.group(2)] = found.group(3)
    return out


FOUND, BARE = imports()


def test_no_module_imports_the_checkouts_jobs_or_diag_by_a_bare_name():
    # `from jobs.sft_eval import ...` worked from the checkout's root only: installed, no module `jobs` exists.
    assert BARE == []


def test_the_import_graph_has_no_cycle():
    edges: dict[str, set[str]] = {}
    for edge in FOUND:
        edges.setdefault(edge.source, set()).add(edge.target)
    cycle = find_cycle(edges)
    assert cycle is None, "an import circle: " + " -> ".join(cycle)
    assert len(FOUND) > 500  # the graph was read: every module's imports


def test_every_module_has_a_floor():
    table = floors()
    assert [path for path in modules().values() if floor_of(path, table) is None] == []


def test_an_import_that_climbs_a_floor_says_why_and_is_listed():
    table = floors()
    upward = {}
    for edge in FOUND:
        if floor_of(edge.target, table) > floor_of(edge.source, table):
            assert edge.reason, (f"{edge.source}:{edge.line} imports {edge.target}, a floor up "
                                 f"(docs/architecture.md): change it, or say why with `# upward: <why>`")
            upward[edge.source, edge.target] = edge.reason
    for (source, target), reason in sorted(upward.items()):
        print(f"upward: {source} -> {target}: {reason}")
    assert set(upward) == set(listed_upward()), "docs/architecture.md's upward imports are not the code's"


def test_the_checks_can_fail(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None
    for folder in ("rlslurm", "jobs", "diag"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "rlslurm" / "a.py").write_text("def f():\n    from rlslurm.b import g  # upward: a test\n")
    (tmp_path / "rlslurm" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from rlslurm.a import f\nimport rlslurm.a\n")
    (tmp_path / "jobs" / "x.py").write_text("from jobs.y import z\n")
    found, bare = imports(tmp_path)
    assert bare == ["jobs/x.py:1"]
    assert {(e.source, e.target, e.reason) for e in found} == {("rlslurm/a.py", "rlslurm/b.py", "a test"),
                                                               ("rlslurm/b.py", "rlslurm/a.py", None)}
    assert floor_of("rlslurm/rl/config.py", [(1, "rlslurm/*/config.py"), (10, "rlslurm/rl/*")]) == 1


def test_the_floors_read_as_the_architecture():
    table = floors()
    order = ["rlslurm/errors.py", "rlslurm/rl/config.py", "rlslurm/checkpoint.py", "rlslurm/config.py",
             "rlslurm/plan/report.py", "diag/drain_gate.py", "rlslurm/boundary.py", "jobs/sft.py",
             "rlslurm/cli/main.py"]
    assert [floor_of(path, table) for path in order] == sorted(floor_of(path, table) for path in order)
