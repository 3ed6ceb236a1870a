"""Event kinds are declared once (rlslurm/events.py), and the source keeps to the declarations.

Read from the source with `ast`, not from a hand-kept list: every `emit(run, KIND, ...)` call (and every
call of a wrapper that passes its parameter on as the kind, such as the supervisor's `_event`), every
constant of rlslurm.events that code names, and every kind a reader names by a string (`read_events(run,
"x")`, `e.get("kind") == "x"`, `e["kind"] in (...)`). The rules:

- code emits only declared kinds, by their constants, with the declared fields;
- every kind a reader names is emitted somewhere; code names kinds only by the constants;
- every declaration has an emitter (the modules it says), and a reader unless it says it is informational;
- a test that looks for a kind by its string looks for a declared kind that something emits;
- docs/events.md is the registry's current table.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlslurm import events

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("rlslurm", "jobs", "diag", "bench")
REGISTRY = "rlslurm/events.py"
READ_CALLS = {"read_events": 1, "events": 1}  # function name -> index of its kind argument
SELECT_CALLS = {"select"}  # every argument after the first is a kind


def _constants() -> dict[str, tuple[str, ...]]:
    """Name in rlslurm.events -> the kind names it stands for (a group stands for each of its kinds)."""
    out = {}
    for name, value in vars(events).items():
        if isinstance(value, events.EventKind):
            out[name] = (value.name,)
        elif isinstance(value, tuple) and value and all(isinstance(v, events.EventKind) for v in value):
            out[name] = tuple(v.name for v in value)
    return out


CONSTANTS = _constants()


@dataclass
class Emit:
    path: str
    line: int
    kind: str | None  # None: named by something else than a constant
    bare: str | None = None  # the string literal, when the kind is one
    keywords: set[str] = field(default_factory=set)
    splat: bool = False


@dataclass
class Scan:
    emits: list[Emit] = field(default_factory=list)
    reads: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # kind -> paths naming it
    bare_reads: list[tuple[str, int, str]] = field(default_factory=list)  # (path, line, literal)
    record_kinds: set[str] = field(default_factory=set)  # `"kind"` values of dict literals (metrics lines)


def _is_kind_lookup(node: ast.AST) -> bool:
    """`x.get("kind", ...)` or `x["kind"]`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "kind"


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for elt in node.elts for v in _literals(elt)]
    return []


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


class _File(ast.NodeVisitor):
    """One source file: its emits (direct and through wrappers) and what it reads."""

    def __init__(self, path: str, tree: ast.Module, scan: Scan):
        self.path, self.scan = path, scan
        self.aliases: set[str] = set()  # names bound to the rlslurm.events module
        self.imported: dict[str, str] = {}  # local name -> constant name, `from rlslurm.events import X as Y`
        self.emit_names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "rlslurm":
                self.aliases |= {a.asname or a.name for a in node.names if a.name == "events"}
            elif isinstance(node, ast.ImportFrom) and node.module == "rlslurm.events":
                for a in node.names:
                    if a.name == "emit":
                        self.emit_names.add(a.asname or a.name)
                    elif a.name in CONSTANTS:
                        self.imported[a.asname or a.name] = a.name
            elif isinstance(node, ast.Import):
                self.aliases |= {a.asname for a in node.names if a.name == "rlslurm.events" and a.asname}
        self.kind_args: set[int] = set()  # id() of the AST nodes that are the kind argument of an emit
        self.wrappers = self._wrappers(tree)

    def constant(self, node: ast.AST) -> str | None:
        """The rlslurm.events constant `node` names, if it names one."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            return node.attr if node.attr in CONSTANTS else None
        if isinstance(node, ast.Name):
            return self.imported.get(node.id)
        return None

    def _is_emit(self, call: ast.Call) -> bool:
        f = call.func
        if isinstance(f, ast.Name):
            return f.id in self.emit_names
        return isinstance(f, ast.Attribute) and f.attr == "emit" and isinstance(f.value, ast.Name) \
            and f.value.id in self.aliases

    def _wrappers(self, tree: ast.Module) -> dict[str, int]:
        """Functions that pass one of their parameters on to emit as the kind: name -> its argument index
        at a call (methods without `self`)."""
        out = {}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in fn.args.args]
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and self._is_emit(call) and len(call.args) > 1 \
                        and isinstance(call.args[1], ast.Name) and call.args[1].id in params:
                    index = params.index(call.args[1].id)
                    out[fn.name] = index - 1 if params and params[0] in ("self", "cls") else index
                    self.kind_args.add(id(call.args[1]))
        return out

    def _record_emit(self, call: ast.Call, kind_node: ast.AST) -> None:
        self.kind_args.add(id(kind_node))
        const = self.constant(kind_node)
        names = CONSTANTS.get(const, (None,)) if const else (None,)
        bare = kind_node.value if isinstance(kind_node, ast.Constant) and isinstance(kind_node.value, str) else None
        for name in names:
            self.scan.emits.append(Emit(self.path, call.lineno, name, bare,
                                        {k.arg for k in call.keywords if k.arg and k.arg not in ("role", "rank")},
                                        any(k.arg is None for k in call.keywords)))

    def visit_Call(self, call: ast.Call) -> None:
        name = _call_name(call)
        if self._is_emit(call) and len(call.args) > 1 and id(call.args[1]) not in self.kind_args:
            self._record_emit(call, call.args[1])
        elif name in self.wrappers and len(call.args) > self.wrappers[name] and not self._is_emit(call):
            self._record_emit(call, call.args[self.wrappers[name]])
        kinds = []
        if name in READ_CALLS and len(call.args) > READ_CALLS[name]:
            kinds = [call.args[READ_CALLS[name]]]
        elif name in SELECT_CALLS:
            kinds = call.args[1:]
        elif name == "startswith" and isinstance(call.func, ast.Attribute) \
                and any(_is_kind_lookup(n) for n in ast.walk(call.func.value)):
            kinds = call.args
        for node in kinds:
            self.scan.bare_reads += [(self.path, call.lineno, v) for v in _literals(node)]
        self.generic_visit(call)

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = [node.left, *node.comparators]
        if any(_is_kind_lookup(s) for s in sides):
            self.scan.bare_reads += [(self.path, node.lineno, v) for s in sides for v in _literals(s)]
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant) and key.value == "kind":
                self.scan.record_kinds.update(_literals(value))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._read(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self._read(node)

    def _read(self, node: ast.AST) -> None:
        const = self.constant(node)
        if const and id(node) not in self.kind_args:
            for name in CONSTANTS[const]:
                self.scan.reads[name].add(self.path)


def scan(dirs: tuple[str, ...], skip: tuple[str, ...] = ()) -> Scan:
    out = Scan()
    for top in dirs:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in skip:
                continue
            tree = ast.parse(path.read_text(), rel)
            visitor = _File(rel, tree, out)
            # Wrapper calls are found while visiting; the kind arguments inside wrappers are marked first.
            visitor.visit(tree)
    return out


@pytest.fixture(scope="module")
def code() -> Scan:
    return scan(CODE_DIRS, skip=(REGISTRY,))


def _emitted(code: Scan) -> dict[str, set[str]]:
    """Kind -> the files that emit it (a declared kind emitted by its string counts here; the constants
    test fails on it)."""
    out = defaultdict(set)
    for e in code.emits:
        name = e.kind or (e.bare if e.bare in events.KINDS else None)
        if name is not None:
            out[name].add(e.path)
    return out


def test_code_emits_only_declared_kinds_by_their_constants(code):
    wrong = [f"{e.path}:{e.line}: emits {e.bare!r}" + (" (not declared)" if e.bare not in events.KINDS else
                                                          " by a string: use its constant from rlslurm.events")
             for e in code.emits if e.kind is None]
    assert not wrong, "\n".join(wrong)


def test_every_emit_carries_the_declared_fields(code):
    wrong = []
    for e in code.emits:
        kind = events.KINDS.get(e.kind or e.bare)
        if kind is None:
            continue
        missing = [] if e.splat else [f for f in kind.required if f not in e.keywords]
        unknown = [] if kind.open_fields else \
            sorted(f for f in e.keywords if f not in (*events.BASE_FIELDS, *kind.required, *kind.optional))
        if missing or unknown:
            wrong.append(f"{e.path}:{e.line}: {kind.name} misses {missing}, has undeclared {unknown}")
    assert not wrong, "\n".join(wrong)


def test_readers_name_only_kinds_that_code_emits(code):
    emitted = _emitted(code)
    dead = [f"{kind} (named in {', '.join(sorted(paths))})" for kind, paths in code.reads.items()
            if kind not in emitted]
    assert not dead, "readers look for kinds that nothing emits: " + "; ".join(dead)


def test_code_names_kinds_by_constants_never_by_strings(code):
    bare = [f"{path}:{line}: {literal!r}" for path, line, literal in code.bare_reads
            if literal not in code.record_kinds or literal in events.KINDS]
    assert not bare, "name these kinds by their rlslurm.events constants:\n" + "\n".join(bare)


def test_every_declaration_has_its_emitters_and_a_reader_or_says_it_is_informational(code):
    emitted = _emitted(code)
    wrong = []
    for kind in events.KINDS.values():
        if kind.name not in emitted:
            wrong.append(f"{kind.name}: declared, but nothing emits it (remove it, or emit it where it happens)")
        elif set(kind.emitted_by) != emitted[kind.name]:
            wrong.append(f"{kind.name}: declared as emitted by {sorted(kind.emitted_by)}, emitted by "
                         f"{sorted(emitted[kind.name])}")
        readers = code.reads.get(kind.name, set())
        if not readers and not kind.informational:
            wrong.append(f"{kind.name}: no reader; declare it informational=True if it is there for people")
        if readers and kind.informational:
            wrong.append(f"{kind.name}: declared informational, but read by {sorted(readers)}")
    assert not wrong, "\n".join(wrong)


def test_tests_look_only_for_declared_kinds_that_code_emits(code):
    from typing import get_args, get_type_hints

    from rlslurm.config import JobSpec

    tests = scan(("tests",), skip=(str(Path(__file__).relative_to(ROOT)),))  # this file names dead kinds on purpose
    emitted = _emitted(code)
    other = code.record_kinds | set(get_args(get_type_hints(JobSpec)["kind"]))  # `kind` of metrics lines, of jobs
    wrong = sorted({f"{path}:{line}: {literal!r}" for path, line, literal in tests.bare_reads
                    if literal not in other and literal not in emitted})
    assert not wrong, "tests look for kinds that nothing emits (a check that cannot fail):\n" + "\n".join(wrong)


def test_emit_refuses_an_undeclared_kind_and_missing_fields(tmp_path):
    from rlslurm.rundir import RunDir

    run = RunDir(tmp_path / "run").create()
    with pytest.raises(ValueError, match="not declared"):
        events.emit(run, "engine_crashed", url="http://x")
    with pytest.raises(ValueError, match="not declared"):
        events.emit(run, events.EventKind(name="done", meaning="a look-alike", emitted_by=("x",)), step=1)
    with pytest.raises(ValueError, match=r"missing required fields \['engine'"):
        events.emit(run, events.SYNC_VERIFY_FAILED, version=2, transport="disk", attempts=2, mismatches=[],
                    rollback=[])
    with pytest.raises(ValueError, match=r"undeclared fields \['colour'\]"):
        events.emit(run, events.START, step=0, restart_count=0, colour="red")
    with pytest.raises(ValueError, match="not declared"):
        events.read_events(run, "reward_service_gave_up")
    assert not run.events.exists()  # nothing was written by a refused emit
    record = events.emit(run, events.START, step=0, restart_count=0, role="train", rank=1)
    assert events.read_events(run, events.START) == [record] == events.read_events(run, "start")
    assert (record["kind"], record["role"], record["rank"]) == ("start", "train", 1)


def test_old_run_directories_still_read(tmp_path):
    """A line of a kind declared no more (written before the rename) is kept, and found by no reader."""
    from rlslurm.rundir import RunDir

    run = RunDir(tmp_path / "run").create()
    run.append_json(run.events, {"t": 1.0, "kind": "reward_service_gave_up", "restarts": 3})
    events.emit(run, events.DONE, step=4)
    assert [e["kind"] for e in events.read_events(run)] == ["reward_service_gave_up", "done"]
    assert events.kind_of(events.read_events(run)[0]) is None and len(events.read_events(run, events.DONE)) == 1
    for data in sorted((ROOT / "tests" / "data").rglob("events.jsonl")):
        assert events.read_events(RunDir(data.parent)), data


def test_the_event_table_in_docs_is_current():
    assert (ROOT / "docs" / "events.md").read_text() == events.markdown(), \
        "docs/events.md is stale: python -m rlslurm.events > docs/events.md"


def test_the_progress_line_says_only_fields_its_kinds_declare():
    """progress.NOTABLE's templates name event fields: each must be one its kind declares (a field it does
    not carry shows as "?" on every line)."""
    from string import Formatter

    from rlslurm.progress import NOTABLE

    wrong = []
    for kind, template in NOTABLE.items():
        named = {f for _, f, _, _ in Formatter().parse(template) if f}
        declared = {*events.BASE_FIELDS, *kind.required, *kind.optional}
        if not kind.open_fields and named - declared:
            wrong.append(f"{kind.name}: {template!r} names {sorted(named - declared)}")
    assert not wrong, "\n".join(wrong)
