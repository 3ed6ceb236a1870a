"""Score given responses against a job's data with its reward, through the real reward service: how a user
checks a reward before spending GPU hours (what verl's offline eval does). `rlslurm score` is its CLI.

    responses = read_responses(Path("responses.jsonl"), table)      # [(row, response)], errors name the line
    results = score_responses(job.reward, [item_for(table.sample(r), text, str(r)) for r, text in responses])
    summary = Summary.of(results, pass_at=1.0)

The service is started as `reward.service: local` starts it (RewardSupervisor: a process of its own on
127.0.0.1, the job's sandbox and worker processes), whatever the config's `reward.service` says: the
numbers are the service's own statuses and reasons, before any retry or `reward.degrade` policy.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlslurm import safejson, secret
from rlslurm.errors import ResponsesError
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import Item

MAX_LINE_CHARS = 64 << 20
"""Longest line of a --responses file read (a response is a model's output: kilobytes)."""


def read_responses(path: Path, rows: int, response_key: str = "responses") -> list[tuple[int, str]]:
    """(row, response) of each line {"row": int, "response": str} of `path`; `rows` = the split's size.
    A `.parquet` is verl's generation output instead (read_generation_parquet)."""
    if not path.is_file():
        raise ResponsesError(f"{path}: no such file (--responses: one JSON object per line, "
                             '{"row": <row of the split>, "response": "..."}, or verl\'s generation parquet)')
    if path.suffix == ".parquet":
        return read_generation_parquet(path, rows, response_key)
    out = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""), 1):
            where = f"{path}:{n}"
            if len(line) > MAX_LINE_CHARS:
                raise ResponsesError(f"{where}: a line over {MAX_LINE_CHARS} characters; no response is that long")
            if not line.strip():
                continue
            try:
                record = safejson.loads(line)
            except json.JSONDecodeError as e:
                raise ResponsesError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            except safejson.JSONLimitError as e:  # a RecursionError or ValueError traceback before issue 37
                raise ResponsesError(f"{where}: the line {e}") from None
            if not isinstance(record, dict):
                raise ResponsesError(f"{where}: a {type(record).__name__}, not an object with row and response")
            row, response = record.get("row"), record.get("response")
            if not isinstance(row, int) or isinstance(row, bool):
                raise ResponsesError(f"{where}: \"row\" must be an integer, got {row!r}")
            if not 0 <= row < rows:
                raise ResponsesError(f"{where}: row {row} is out of range: the split has rows 0..{rows - 1}")
            if not isinstance(response, str):
                raise ResponsesError(f"{where}: \"response\" must be text, got {type(response).__name__}")
            out.append((row, response))
    if not out:
        raise ResponsesError(f"{path}: holds no responses")
    return out


def read_generation_parquet(path: Path, rows: int, response_key: str = "responses") -> list[tuple[int, str]]:
    """(row, response) of each response of verl's generation output (`verl.trainer.main_generation` writes
    its input dataset back with a `responses` column, a list of n samples per row, which verl's offline
    eval scores): row i of the file is row i of the split, so the file must have the split's row count."""
    import pyarrow.parquet as pq  # one column of a file verl wrote: no dataset features, no cache to build

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise ResponsesError(f"{path}: not a parquet file ({e})") from None
    if response_key not in table.column_names:
        raise ResponsesError(f"{path}: no column {response_key!r} (verl's generation output has one; name "
                             f"another with --response-key); columns: {', '.join(table.column_names)}")
    if table.num_rows != rows:
        raise ResponsesError(f"{path}: {table.num_rows} rows, the split has {rows}: row i of verl's generation "
                             "output must be row i of the split scored (--split, data.eval)")
    out = []
    for row, value in enumerate(table.column(response_key).to_pylist()):
        samples = value if isinstance(value, list) else [value]
        for n, text in enumerate(samples):
            if not isinstance(text, str):
                raise ResponsesError(f"{path}: row {row}, column {response_key!r}"
                                     f"{f' sample {n}' if isinstance(value, list) else ''}: "
                                     f"a {type(text).__name__}, not text")
            out.append((row, text))
    if not out:
        raise ResponsesError(f"{path}: holds no responses")
    return out


@dataclass(frozen=True)
class Result:
    """One response's answer from the service."""

    id: str
    score: float | None
    status: str
    reason: str


def score_responses(cfg: RewardConfig, items: list[Item], work_dir: Path | None = None) -> list[Result]:
    """`items` scored by a reward service started for `cfg` (logs in `work_dir`, else a temp dir), in order."""
    from rlslurm.reward.supervisor import RewardSupervisor

    log_dir = Path(work_dir or tempfile.mkdtemp(prefix="rlslurm-score-"))
    with RewardSupervisor(cfg, log_dir=log_dir) as service:
        return asyncio.run(_post_all(cfg, service.url, service.token, items))


async def _post_all(cfg: RewardConfig, url: str, token: str, items: list[Item]) -> list[Result]:
    batch = min(cfg.batch_size, cfg.max_items_per_request)
    batches = [items[i:i + batch] for i in range(0, len(items), batch)]
    # All requests go at once and the service scores `concurrency` items at a time, each within timeout_s:
    # the last item is answered within that many waves.
    bound_s = math.ceil(len(items) / cfg.concurrency) * cfg.timeout_s + 30
    async with httpx.AsyncClient(timeout=bound_s, headers=secret.bearer(token)) as http:
        async def post(chunk: list[Item]) -> list[Result]:
            try:
                reply = await http.post(url + "/score", json={"items": [item.__dict__ for item in chunk]})
                reply.raise_for_status()
                return [Result(r["id"], r["score"], r["status"], r["reason"]) for r in reply.json()["results"]]
            except (httpx.HTTPError, ValueError, KeyError) as e:
                return [Result(item.id, None, "error", f"request failed: {e!r}"[:300]) for item in chunk]

        done = await asyncio.gather(*(post(chunk) for chunk in batches))
    return [r for chunk in done for r in chunk]


@dataclass(frozen=True)
class Summary:
    """Mean reward over the scored responses, pass rate over all of them, counts by status and reason."""

    count: int
    mean: float | None
    passed: int
    pass_at: float
    statuses: Counter
    reasons: Counter

    @classmethod
    def of(cls, results: list[Result], pass_at: float) -> "Summary":
        scores = [r.score for r in results if r.score is not None]
        return cls(len(results), sum(scores) / len(scores) if scores else None,
                   sum(r.score is not None and r.score >= pass_at for r in results), pass_at,
                   Counter(r.status for r in results), Counter(r.reason for r in results))

    @property
    def pass_rate(self) -> float:
        return self.passed / self.count if self.count else 0.0

    def lines(self, reasons: int = 5) -> list[str]:
        mean = "n/a (nothing scored)" if self.mean is None else f"{self.mean:.4f}"
        out = [f"mean reward {mean}",
               f"pass rate {self.pass_rate:.3f} ({self.passed}/{self.count} with score >= {self.pass_at:g})",
               "status: " + ", ".join(f"{k} {v}" for k, v in sorted(self.statuses.items())),
               "most common reasons:"]
        out += [f"  {n:6d}  {reason}" for reason, n in self.reasons.most_common(reasons)]
        return out
