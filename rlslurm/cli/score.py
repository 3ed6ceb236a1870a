"""`rlslurm score CONFIG --responses FILE.jsonl`: score given responses against CONFIG's data with CONFIG's
reward, through the real reward service, and print the mean, the pass rate and the reasons.

    rlslurm score examples/score-humaneval.yaml --responses runs/humaneval-canonical.jsonl
    rlslurm score job.yaml --responses out.jsonl --split train --show 5 --out scored.jsonl

Each line of FILE.jsonl is {"row": <row of the split, 0-based>, "response": "..."}; the held-out split
(data.eval, or data.eval_fraction's rows) by default. A FILE.parquet is verl's generation output (its input
dataset with a `responses` column of n samples per row): row i scored against row i of the split.
A response passes when it is scored >= --pass-at (1.0: a rule or code scorer's right answer); the mean is
over the responses that were scored.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("score")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--responses", "responses_path", required=True, type=click.Path(dir_okay=False),
              help='jsonl of {"row": N, "response": "..."}, one per line; or verl\'s generation parquet.')
@click.option("--response-key", default="responses", show_default=True,
              help="A parquet's column of responses (verl's data.response_key).")
@click.option("--split", type=click.Choice(["eval", "train"]), default="eval", show_default=True,
              help="The split whose rows `row` counts: held-out (eval) or train.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key, e.g. "
              "reward.timeout_s=30.")
@click.option("--pass-at", type=float, default=1.0, show_default=True,
              help="Score at or above which a response passes.")
@click.option("--show", type=int, default=0, help="Print this many responses that did not pass, with their reasons.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False),
              help="Write one {row, score, status, reason} line per response here.")
def command(config: str, responses_path: str, response_key: str, split: str, overrides: tuple[str, ...],
            pass_at: float, show: int, out_path: str | None) -> None:
    """Score RESPONSES against CONFIG's data with its reward: mean, pass rate, statuses and reasons."""
    from rlslurm.config import load_config
    from rlslurm.data.splits import load_splits
    from rlslurm.outfile import write_file
    from rlslurm.reward.items import item_for
    from rlslurm.reward.offline import Summary, read_responses, score_responses

    job = load_config(config, overrides)
    train, held_out = load_splits(job)
    table = held_out if split == "eval" else train
    responses = read_responses(Path(responses_path), len(table), response_key)
    items = [item_for(table.sample(row), text, str(i)) for i, (row, text) in enumerate(responses)]
    click.echo(f"{config}: {len(items)} responses to the {split} split ({table.source}), "
               f"reward.scorer = {job.reward.scorer}")
    results = score_responses(job.reward, items)
    summary = Summary.of(results, pass_at)
    for line in summary.lines():
        click.echo(line)
    failed = [(row, r) for (row, _), r in zip(responses, results) if r.score is None or r.score < pass_at]
    for row, r in failed[:show]:
        click.echo(f"row {row}: {r.status} {r.score} {r.reason}")
    if out_path is not None:
        write_file(out_path, "".join(json.dumps({"row": row, "score": r.score, "status": r.status,
                                                 "reason": r.reason}) + "\n"
                                     for (row, _), r in zip(responses, results)), replace=True)
        click.echo(f"wrote {out_path}")
