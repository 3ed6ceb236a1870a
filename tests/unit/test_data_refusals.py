"""Bad data is refused before anything runs: `rlslurm validate` and `rlslurm submit` read each malformed
file below and name its file, row and column (and the line of a .jsonl) in one message, exit non-zero
with no traceback, and `submit` creates no run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlslurm.cli.main import cli
from rlslurm.errors import ConfigError


def _jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))


def _disk(path: Path, rows: list[dict]) -> None:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))


OK = {"prompt": "1*2=", "completion": "2"}
CHAT_OK = {"messages": [{"role": "user", "content": "1*2"}, {"role": "assistant", "content": "2"}]}

# name: (file name, how to write it, extra data: keys, expected row, line, column, words in the message)
CASES = {
    "not-json": ("t.jsonl", _jsonl(OK, OK, b'{"prompt": "3*4=", "completion": 12'), {}, 2, 3, "column 36",
                 "not JSON"),
    "not-an-object": ("t.jsonl", _jsonl(OK, ["3*4=", "12"]), {}, 1, 2, "'(row)'", "is a list, not an object"),
    "empty-prompt": ("t.jsonl", _jsonl(OK, OK, OK, {"prompt": "  ", "completion": "1"}), {}, 3, 4, "'prompt'",
                     "empty prompt"),
    "missing-completion": ("t.jsonl", _jsonl(OK, {"prompt": "3*4="}), {}, 1, 2, "'completion'", "is missing"),
    "completion-a-number": ("t.jsonl", _jsonl(OK, {"prompt": "3*4=", "completion": 12}), {}, 1, 2, "'completion'",
                            "is a int; a completion must be text"),
    "prompt-a-mapping": ("t.jsonl", _jsonl({"prompt": {"q": "3*4="}, "completion": "12"}), {}, 0, 1, "'prompt'",
                         "a prompt must be text or a list"),
    "messages-not-a-list": ("t.jsonl", _jsonl(CHAT_OK, {"messages": "3*4=12"}), {}, 1, 2, "'messages'",
                            "list of {role, content} messages"),
    "message-without-content": ("t.jsonl", _jsonl(CHAT_OK, {"messages": [{"role": "user", "content": "1"},
                                                                         {"role": "assistant"}]}),
                                {}, 1, 2, "'messages[1]'", "must be a message"),
    "unknown-role": ("t.jsonl", _jsonl({"messages": [{"role": "robot", "content": "1*2"},
                                                     {"role": "assistant", "content": "2"}]}),
                     {}, 0, 1, "'messages[0].role'", "must be one of system, user, assistant"),
    "no-assistant-turn": ("t.jsonl", _jsonl(CHAT_OK, CHAT_OK, {"messages": [{"role": "user", "content": "1*2"}]}),
                          {}, 2, 3, "'messages'", "has no completion to learn"),
    "ground-truth-wrong-type": ("t.parquet", [OK | {"ground_truth": {"v": "2"}}], {}, 0, None, "'ground_truth'",
                                "is a mapping; a ground truth must be text or a number"),
    "reference-a-list": ("t.jsonl", _jsonl(OK | {"answer": "2"}, {"prompt": "3*4=", "completion": "12",
                                                                   "answer": [12]}),
                         {}, 1, 2, "'answer'", "a ground truth must be text or a number"),
    "null-prompt-parquet": ("t.parquet", [OK, {"prompt": None, "completion": "12"}], {}, 1, None, "'prompt'",
                            "is null"),
    "too-long": ("t.jsonl", _jsonl(OK, {"prompt": "1*2=", "completion": "1" * 200}), {}, 1, 2, "'completion'",
                 "is too long: prompt + completion + </s> is 206 tokens, model.max_positions = 64"),
    "empty-completion-in-disk-dir": ("t.dir", [OK, OK, {"prompt": "3*4=", "completion": ""}], {}, 2, None,
                                     "'completion'", "is an empty completion"),
    "dotted-column-missing-in-struct": ("t.parquet", [{"question": {"text": "1*2="}, "completion": "2"},
                                                      {"question": {"other": "3*4="}, "completion": "12"}],
                                        {"layout": "columns", "columns": {"prompt": "question.text",
                                                                          "completion": "completion"}},
                                        1, None, "'question.text'", "is null"),  # parquet: a struct's absent field
    "not-utf8": ("t.jsonl", _jsonl(OK, b'{"prompt": "\xff\xfe", "completion": "1"}'), {}, 1, 2, None, "not UTF-8"),
    # Issue 37: hostile JSON is named (it was a RecursionError / ValueError traceback) and a long row is measured
    # in bytes before it is tokenized.
    "nested-100k-deep": ("t.jsonl", _jsonl(OK, b'{"prompt": "1*2=", "completion": "2", "x": ' + b"[" * 100_000
                                           + b"]" * 100_000 + b"}"), {}, None, None, "row 1 (line 2)",
                         "is nested deeper than 64 levels of arrays and objects"),
    "nested-100k-deep-json": ("t.json", b"[" * 100_000 + b"]" * 100_000, {}, None, None, None,
                              "is nested deeper than 65 levels"),
    "integer-of-100k-digits": ("t.jsonl", _jsonl(OK, b'{"prompt": "1*2=", "completion": "2", "n": ' + b"7" * 100_000
                                                 + b"}"), {}, None, None, "row 1 (line 2)",
                               "holds an integer longer than 4300 digits"),
    "prompt-megabytes-long": ("t.jsonl", _jsonl(OK, {"prompt": "1*2=" * 250_000, "completion": "2"}), {}, 1, 2,
                              "'prompt'", "is too long: the prompt is 1.0 MB: more than 64 tokens can hold (320 B, "
                                          "5 bytes for the vocabulary's longest token), so it is refused before "
                                          "tokenizing; model.max_positions = 64"),
}

def _write(path: Path, content) -> None:
    if path.suffix == ".dir":
        _disk(path, content)
    elif path.suffix == ".parquet":
        _parquet(path, content)
    else:
        path.write_bytes(content)


def _config(tmp_path: Path, data_file: Path, extra: dict) -> Path:
    data = {"train": str(data_file), "eval_fraction": 0.5, **extra}
    job = {"job": {"name": "bad-data", "kind": "sft"}, "placement": {"mode": "colocate"},
           "hardware": {"nodes": 1, "gpus_per_node": 1}, "model": {"max_positions": 64}, "data": data}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    return path


def _refused(result, data_file: Path, row, line, column, words) -> None:
    assert result.exit_code == ConfigError.exit_code, result.output
    out = result.output
    assert "Traceback" not in out and result.exc_info[0] is SystemExit, out
    (message,) = [m for m in out.splitlines() if m.startswith("rlslurm: error: ")]
    assert f"data.train = {data_file}" in message, message
    if row is not None:
        assert f"row {row}" + (f" (line {line})" if line is not None else "") + ", column " in message, message
    if column is not None:
        assert column in message, message
    assert words in message, message


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_malformed_file_is_refused_by_validate_and_submit(tmp_path, name):
    filename, content, extra, row, line, column, words = CASES[name]
    data_file = tmp_path / filename
    _write(data_file, content)
    config = _config(tmp_path, data_file, extra)
    runner = CliRunner()
    _refused(runner.invoke(cli, ["validate", str(config)]), data_file, row, line, column, words)
    run_root = tmp_path / "runs"
    result = runner.invoke(cli, ["submit", str(config), "--backend", "local", "--run-root", str(run_root)])
    _refused(result, data_file, row, line, column, words)
    assert not run_root.exists(), "submit created something for a refused job"


def test_missing_file_and_unknown_form_are_named(tmp_path):
    runner = CliRunner()
    for name, words in (("nope.jsonl", "no such file or directory"), ("t.csv", "unknown file type '.csv'")):
        if name.endswith(".csv"):
            (tmp_path / name).write_text("prompt,completion\n1*2=,2\n")
        config = _config(tmp_path, tmp_path / name, {})
        for args in (["validate", str(config)], ["submit", str(config), "--run-root", str(tmp_path / "runs")]):
            result = runner.invoke(cli, args)
            assert result.exit_code == ConfigError.exit_code and words in result.output, result.output
            assert f"data.train = '{tmp_path / name}'" in result.output
    assert not (tmp_path / "runs").exists()


def test_a_layout_that_fits_no_column_is_named(tmp_path):
    data_file = tmp_path / "t.jsonl"
    data_file.write_bytes(_jsonl({"question": "1*2=", "label": "2"}))
    result = CliRunner().invoke(cli, ["validate", str(_config(tmp_path, data_file, {}))])
    assert result.exit_code == ConfigError.exit_code
    assert "cannot tell the layout from the columns ['question', 'label']" in result.output
    result = CliRunner().invoke(cli, ["validate", str(_config(tmp_path, data_file, {
        "layout": "columns", "columns": {"prompt": "question", "completion": "answer"}}))])
    assert "column 'answer' is missing (data.layout = columns, the completion column 'answer')" in result.output


def test_good_files_pass_and_say_what_was_checked(tmp_path):
    data_file = tmp_path / "t.jsonl"
    data_file.write_bytes(_jsonl(*[OK] * 5))
    result = CliRunner().invoke(cli, ["validate", str(_config(tmp_path, data_file, {}))])
    assert result.exit_code == 0, result.output
    assert f"data.train = {data_file}: ok, 5 rows checked; layout trl_prompt_completion" in result.output


def test_a_long_row_is_named_in_milliseconds_and_megabytes(tmp_path):
    """Issue 37: validate tokenized a whole row before comparing it with the context: a 5 MB prompt cost 9.9 s and
    2.1 GB (a 50 MB one 115 s and 19.2 GB). Now it is refused by its bytes: this process grows by little more than
    the row it read (bench/bench_long_row.py: 50 MB in 0.4 s of checking)."""
    import threading
    import time

    import psutil

    from rlslurm.config import load_config
    from rlslurm.data.check import check_data
    from rlslurm.data.layout import DataError

    data_file = tmp_path / "t.jsonl"
    data_file.write_bytes(_jsonl({"prompt": "12+7=" * 1_000_000, "completion": "19"}, OK, OK))
    job = load_config(_config(tmp_path, data_file, {}))
    me, peak, stop = psutil.Process(), [0.0], threading.Event()
    base = me.memory_info().rss

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss - base)
            stop.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    with pytest.raises(DataError, match=r"row 0 \(line 1\), column 'prompt': is too long: the prompt is 5.0 MB"):
        check_data(job)
    took = time.monotonic() - started
    stop.set()
    sampler.join()
    assert took < 3 and peak[0] < 200 * 2**20, (took, peak[0] / 2**20)
