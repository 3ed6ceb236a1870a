"""Every command README.md and docs/*.md show must parse; the file map (docs/architecture.md) and the reference config
(docs/reference-config.yaml) must stay true; the README stays a short front door.

A command is a line of a fenced code block that starts with `rlslurm ` (in a bash/sh block) or `$ rlslurm `
(in any block: shown output), or an inline code span that starts with `rlslurm `. Placeholders are filled
in (`<jobid|rundir>` -> a job id, `[--json]` -> `--json`, `local|slurm` -> `local`, `...` dropped), then
click parses the line as `rlslurm` would (`make_context`: the subcommand, every option, its type and
choices, the arguments) without running it. Prose names a command without its arguments (`rlslurm plan`
exits 3 when ...), so an inline span is parsed with `--help` appended: the subcommand and the options
before it must exist. `python -m X` lines name a module that must exist, `python
path.py` / `bash path.sh` a file, `make X` a target of the Makefile.

    python -m pytest -q tests/unit/test_docs_commands.py
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import click
import pytest

from rlslurm.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"(?<!`)`(rlslurm [^`]+)`(?!`)")


def commands_in(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every command shown in a Markdown text (continuation lines joined)."""
    found: list[tuple[int, str]] = []
    block: str | None = None
    pending = ""
    for n, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            block = None if block is not None else fence.group(1).lower()
            continue
        if block is None:
            found += [(n, m.group(1).replace("\\|", "|") + " --help") for m in _INLINE.finditer(line)]
            continue
        stripped = line.strip()
        if pending:
            stripped, pending = pending + " " + stripped, ""
        if stripped.endswith("\\"):
            pending = stripped[:-1].rstrip()
            continue
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        elif block not in SHELL_BLOCKS:
            continue
        if re.match(r"(rlslurm|python|make|bash) ", stripped) and not stripped.startswith("rlslurm:"):
            found.append((n, stripped))
    return found


def _words(command: str) -> list[list[str]]:
    """The command's words, placeholders filled in; `a && b` gives two commands."""
    command = re.sub(r"<jobid\|rundir>|<jobid>|<rundir>", "12345", command)
    command = re.sub(r"<[^<>\s]+>", "x", command)
    command = re.sub(r"\[([^\[\]]+)\]", r"\1", command)  # [--json] -> --json, [B] -> B
    out: list[list[str]] = [[]]
    for word in shlex.split(command, comments=True):
        if word == "&&":
            out.append([])
        elif word not in ("...", "|"):
            out[-1].append(word.split("|")[0] if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", word) else word)
    return [w for w in out if w]


def check(command: str) -> None:
    """Raise AssertionError (click's own message) unless every part of `command` parses or exists."""
    for words in _words(command):
        head, args = words[0], words[1:]
        if head == "rlslurm":
            while args and args[0] in ("--debug", "--version", "--help", "-h"):  # the group's own options
                if args[0] != "--debug":
                    return
                args = args[1:]
            assert args, f"{command!r}: no subcommand"
            sub = cli.commands.get(args[0])
            assert sub is not None, f"{command!r}: no command {args[0]!r}; rlslurm has {sorted(cli.commands)}"
            try:
                sub.make_context(args[0], list(args[1:]))
            except click.exceptions.Exit:  # --help: the options before it parsed
                pass
            except click.ClickException as e:
                raise AssertionError(f"{command!r}: {e.format_message()}") from None
        elif head == "python" and args[:1] == ["-m"]:
            assert importlib.util.find_spec(args[1]) is not None, f"{command!r}: no module {args[1]}"
        elif head in ("python", "bash"):
            assert (ROOT / args[0]).is_file(), f"{command!r}: no file {args[0]}"
        elif head == "make":
            targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
            assert all(t in targets for t in args), f"{command!r}: Makefile targets are {targets}"


def _shown() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)}:{n}", cmd) for path in DOCS for n, cmd in commands_in(path.read_text())]


SHOWN = _shown()


@pytest.mark.parametrize("where,command", SHOWN, ids=[w for w, _ in SHOWN])
def test_every_documented_command_parses(where, command):
    check(command)


def test_the_docs_show_the_commands_users_run():
    shown = " ".join(cmd for _, cmd in SHOWN)
    for name in cli.commands:
        assert f"rlslurm {name}" in shown, f"no doc shows rlslurm {name}"
    assert len(SHOWN) > 40


BROKEN = """Shown wrong:

```bash
rlslurm submit examples/tiny-grpo.yaml --no-such-flag
rlslurm frobnicate job.yaml
rlslurm submit job.yaml --backend kubernetes
rlslurm init --kind dpo -o x.yaml
python -m rlslurm.no_such_module
make deploy
```

and inline: `rlslurm status <jobid|rundir> --watch`, `rlslurm stats`.
"""


def test_a_doc_showing_a_missing_command_or_option_fails():
    found = commands_in(BROKEN)
    assert len(found) == 8
    for _, command in found:
        with pytest.raises(AssertionError):
            check(command)


def test_placeholders_and_continuations_are_read():
    text = ("```bash\nrlslurm submit job.yaml \\\n    --set train.steps=5 --wait   # comment\n```\n```\n"
            "$ rlslurm plan examples/lecture-h20.yaml [--json] [--explain]\nrlslurm plan: output, not a command\n```\n")
    assert [c for _, c in commands_in(text)] == ["rlslurm submit job.yaml --set train.steps=5 --wait   # comment",
                                                 "rlslurm plan examples/lecture-h20.yaml [--json] [--explain]"]
    for _, command in commands_in(text):
        check(command)
    assert _words("rlslurm resume <jobid|rundir> --backend local|slurm ...") == [
        ["rlslurm", "resume", "12345", "--backend", "local"]]


README_MAX_LINES = 150
"""The README is the front door (what it is, the two commands, the tour, links): details go to docs/."""


def test_every_docs_page_is_linked_from_the_readme_and_it_stays_short():
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f"(docs/{p})" not in readme] == []
    # The file map grows one line per module: it lives in docs/architecture.md, not here.
    assert "## File map" not in readme
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README is the front door: details go to docs/"
    first = "\n".join(readme.splitlines()[:40])
    assert "make demo" in first and "make test" in first


def _file_map() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    body = text.split("## File map", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in body.splitlines() if line and not line.startswith(" ")]


def test_the_file_map_is_true():
    listed = _file_map()
    assert [p for p in listed if not (ROOT / p).exists()] == [], "the file map names paths that do not exist"
    modules = sorted(str(p.relative_to(ROOT)) for top in ("rlslurm", "jobs", "diag")
                     for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py" or p.parent.name == "rlslurm")
    assert [m for m in modules if m not in listed] == [], "modules missing from docs/architecture.md's file map"


REFERENCE_JOB = "job: {kind: rl}\n"
"""The job docs/reference-config.yaml is `rlslurm validate --print` of: every other key at its default."""


def test_the_reference_config_is_what_validate_prints(tmp_path):
    from click.testing import CliRunner

    (tmp_path / "job.yaml").write_text(REFERENCE_JOB)
    printed = CliRunner().invoke(cli, ["validate", str(tmp_path / "job.yaml"), "--print"], catch_exceptions=False)
    assert printed.exit_code == 0, printed.output
    committed = (ROOT / "docs" / "reference-config.yaml").read_text()
    header = [line for line in committed.splitlines(keepends=True) if line.startswith("#")]
    assert committed == "".join(header) + printed.output, (
        "docs/reference-config.yaml is not what `rlslurm validate --print` prints now: regenerate it with the "
        "command at its head (a config key's default changed, or one was added)")
    assert len(header) == 6 and REFERENCE_JOB.strip() in header[1]
