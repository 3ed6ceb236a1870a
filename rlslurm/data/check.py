"""What `rlslurm validate` and `rlslurm submit` read of a job's data files before anything is created.

    for line in check_data(job):       # DataError naming file, row and column of the first bad row
        print(line)                    # data.train = train.jsonl: ok, 1000 rows checked (trl_prompt_completion ...)

Each file is read by a reader of its own form (so "not JSON at line N" names the line `datasets` would only
refuse as a whole), at most data.check_rows rows and data.check_time_s seconds each: the rows the job needs
(prompt, completion for SFT, reference or tests for RL), their types, and their length in the model's tokens.

Rows may be hostile, or just broken: JSON is read with bounded nesting and integers (rlslurm/safejson.py), a
line past MAX_LINE_BYTES is refused unread, and a text is measured in bytes against the tokens it may take
before a tokenizer sees it (rlslurm/textbound.py): a 50 MB prompt cost 115 s and 19.2 GB before it was named,
now well under a second and a few hundred MB (docs/data.md has the bench).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

from rlslurm import safejson
from rlslurm.data.layout import DataError, RowError, resolve
from rlslurm.data.source import kind_of, open_dataset
from rlslurm.data.splits import needs
from rlslurm.data.table import row_error
from rlslurm.data.tokens import encode, prompt_ids, prompt_text
from rlslurm.textbound import longest_token_bytes, megabytes, too_long, utf8_bytes

MAX_LINE_BYTES = 256 << 20
"""Longest line of a .jsonl file read (and largest .json file): no row of any model's context is that long."""

Row = tuple[int, int | None, object]
"""(row index from 0, line number or None, the parsed row)."""


def _jsonl_rows(path: Path, source: str) -> Iterator[Row]:
    row = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{source}: row {row} (line {line_no}) is over {megabytes(MAX_LINE_BYTES)}; no "
                                f"row of a model's context is that long (rlslurm/data/check.py MAX_LINE_BYTES)")
            if not raw or raw.isspace():
                continue  # `datasets` skips blank lines too: they are no row
            try:
                value = safejson.loads(raw)  # the line's end is JSON whitespace: no copy of the row to strip it
            except UnicodeDecodeError as e:
                raise DataError(f"{source}: row {row} (line {line_no}), column {e.start + 1}: not UTF-8 text "
                                f"({e.reason} at byte {e.start + 1} of the line)") from None
            except json.JSONDecodeError:
                e = _decode_error(raw)  # where, in the line without its end (which json counts as a line of its own)
                raise DataError(f"{source}: row {row} (line {line_no}), column {e.colno}: not JSON ({e.msg}); "
                                f"a .jsonl file holds one JSON object per line") from None
            except safejson.JSONLimitError as e:
                raise DataError(f"{source}: row {row} (line {line_no}) {e}") from None
            yield row, line_no, value
            row += 1


def _decode_error(raw: bytes) -> json.JSONDecodeError:
    try:
        json.loads(raw.rstrip(b"\r\n"))
    except json.JSONDecodeError as e:
        return e
    return json.JSONDecodeError("not JSON", raw.decode(errors="replace"), 0)


def _json_rows(path: Path, source: str) -> Iterator[Row]:
    if path.stat().st_size > MAX_LINE_BYTES:
        raise DataError(f"{source}: a .json data file of {megabytes(path.stat().st_size)} is read whole; past "
                        f"{megabytes(MAX_LINE_BYTES)} write it as .jsonl (one row per line) or parquet")
    try:
        value = safejson.loads(path.read_bytes(), max_depth=safejson.MAX_DEPTH + 1)  # + the list of rows
    except UnicodeDecodeError as e:
        raise DataError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{source}: line {e.lineno}, column {e.colno}: not JSON ({e.msg})") from None
    except safejson.JSONLimitError as e:
        raise DataError(f"{source}: {e}") from None
    if not isinstance(value, list):
        raise DataError(f"{source}: a .json data file must hold a list of row objects (one per row), not a "
                        f"{type(value).__name__}; or write it as .jsonl, one object per line")
    for i, item in enumerate(value):
        yield i, None, item


def _arrow_rows(path: Path, source: str, kind: str) -> Iterator[Row]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(str(path)).iter_batches(batch_size=256)
        except Exception as e:
            raise DataError(f"{source}: not a parquet file ({type(e).__name__}: {str(e)[:200]})") from None
        row = 0
        for batch in batches:
            for item in batch.to_pylist():
                yield row, None, item
                row += 1
        return
    ds = open_dataset(path, source.split(" = ")[0])
    for i in range(len(ds)):
        yield i, None, ds[i]


def rows_of(path: str, key: str) -> Iterator[Row]:
    """The rows of a data file in order, parsed by its own form's reader; DataError at the first that is not
    a row."""
    kind, source = kind_of(path, key), f"{key} = {path}"
    p = Path(path)
    if kind == "jsonl":
        return _jsonl_rows(p, source)
    if kind == "json":
        return _json_rows(p, source)
    return _arrow_rows(p, source, kind)


def check_file(job, path: str, key: str, tokenizer) -> str:
    """Check the first data.check_rows rows of one file (for at most data.check_time_s); the line `validate`
    prints. DataError names file, row (and line) and column of the first bad row."""
    data, source, need = job.data, f"{key} = {path}", needs(job)
    deadline = time.monotonic() + data.check_time_s
    layout, checked, stopped = None, 0, ""
    for row, line, value in rows_of(path, key):
        if not isinstance(value, dict):
            raise row_error(source, row, RowError("(row)", f"is a {type(value).__name__}, not an object of "
                                                            f"columns"), line)
        if layout is None:
            layout = resolve(data, list(value), source)
        try:
            sample = layout.sample(value, row, need=need)
        except RowError as e:
            raise row_error(source, row, e, line) from None
        _check_length(job, tokenizer, sample, layout, source, row, line)
        checked += 1
        if checked >= data.check_rows:
            stopped = f" (data.check_rows = {data.check_rows})"
            break
        if time.monotonic() > deadline:
            stopped = f" (data.check_time_s = {data.check_time_s:g} s)"
            break
    if layout is None:
        raise DataError(f"{source}: holds no rows")
    return f"{source}: ok, {checked} rows checked{stopped}; layout {layout.describe()}"


def _check_length(job, tokenizer, sample, layout, source: str, row: int, line: int | None) -> None:
    """A row past model.max_positions is refused; its text is measured in bytes first (rlslurm/textbound.py), so a
    row no tokenizer could fit is named before one runs on it."""
    limit, per_token = job.model.max_positions, longest_token_bytes(tokenizer)
    prompt_column = layout.prompt or layout.messages or "prompt"

    def refuse(column: str, what: str) -> None:
        raise row_error(source, row, RowError(column, f"is too long: {what}"), line)

    text = prompt_text(tokenizer, sample.prompt)  # a conversation rendered by the chat template, as it is encoded
    if job.job.kind == "sft":
        fix = "set data.too_long = truncate to cut the completion, or use a model with more positions"
        column = layout.completion or layout.messages or "completion"
        if problem := too_long(text, tokens=limit, per_token=per_token, what="the prompt"):
            refuse(prompt_column, f"{problem}; model.max_positions = {limit}")
        if job.data.too_long == "truncate":
            prompt = len(prompt_ids(tokenizer, sample))
            if prompt >= limit:
                refuse(prompt_column, f"the prompt is {prompt} tokens, model.max_positions = {limit}: no completion "
                                      "token would be left to learn")
            return  # the job cuts the completion, as configured: its length does not matter
        size = utf8_bytes(text) + utf8_bytes(sample.completion or "")
        if size > limit * per_token:
            refuse(column, f"prompt + completion is {megabytes(size)}: more than model.max_positions = {limit} "
                           f"tokens can hold ({megabytes(limit * per_token)}, {per_token} bytes for the vocabulary's "
                           f"longest token), so it is refused before tokenizing ({fix})")
        tokens = len(encode(tokenizer, sample)[0])
        if tokens > limit:
            refuse(column, f"prompt + completion + </s> is {tokens} tokens, model.max_positions = {limit} ({fix})")
        return
    budget = limit - job.rollout.max_new_tokens
    if problem := too_long(text, tokens=max(0, budget), per_token=per_token, what="the prompt"):
        refuse(prompt_column, f"{problem}; model.max_positions = {limit} less rollout.max_new_tokens = "
                              f"{job.rollout.max_new_tokens} (use a model with more positions)")
    tokens = len(prompt_ids(tokenizer, sample)) + job.rollout.max_new_tokens
    if tokens > limit:
        refuse(prompt_column, f"prompt + rollout.max_new_tokens is {tokens} tokens, model.max_positions = {limit} "
                              "(use a model with more positions)")


def check_data(job) -> list[str]:
    """Check every data file of the job; one line per file (none without data.train)."""
    if job.data.train is None:
        return []
    from rlslurm.data.tokens import job_tokenizer

    tokenizer = job_tokenizer(job)
    lines = [check_file(job, job.data.train, "data.train", tokenizer)]
    if job.data.eval is not None:
        lines.append(check_file(job, job.data.eval, "data.eval", tokenizer))
    return lines
