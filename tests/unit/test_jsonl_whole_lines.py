"""A run's JSON lines are appended whole or not at all (rlslurm/rundir.py append_line), issue 38: a full disk left
events.jsonl and metrics.jsonl ending in half a line, and a later resume's `submitted` event ran on from it, so
neither could be read. A real full disk (a small tmpfs) is in tests/integration/test_jsonl_full_disk.py; here the
two ways a line tears, by hand: a short write(2), and a writer killed mid-line."""

from __future__ import annotations

import errno
import json
import os

import pytest

from rlslurm import events
from rlslurm.rundir import RunDir, append_line, read_jsonl


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line parses, or this raises


def test_a_short_write_is_taken_back_and_raised(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_line(path, b'{"step": 1}\n')
    real = os.write

    def half(fd, data):  # what write(2) does on a disk with less room than the line
        return real(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError) as raised:
        append_line(path, b'{"step": 2, "loss": 0.5}\n')
    assert raised.value.errno == errno.ENOSPC and "cut off again" in str(raised.value)
    monkeypatch.setattr(os, "write", real)
    assert path.read_bytes() == b'{"step": 1}\n'  # nothing of the failed line is left
    append_line(path, b'{"step": 2}\n')
    assert _lines(path) == [{"step": 1}, {"step": 2}]


def test_a_write_that_fails_outright_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    append_line(path, b'{"kind": "start"}\n')

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError):
        append_line(path, b'{"kind": "resume"}\n')
    monkeypatch.undo()
    assert path.read_bytes() == b'{"kind": "start"}\n'


def test_a_torn_tail_left_by_a_killed_writer_is_cut_before_the_next_line(tmp_path):
    run = RunDir(tmp_path).create()
    events.emit(run, events.START, step=0, restart_count=0)
    with open(run.events, "ab") as f:  # a writer SIGKILLed in the middle of its line
        f.write(b'{"t": 1.0, "kind": "checkpoint_sav')
    events.emit(run, events.RESUME, step=0, checkpoint="step-00000000", restart_count=1)
    assert [e["kind"] for e in _lines(run.events)] == ["start", "resume"]
    assert [e["kind"] for e in read_jsonl(run.events)] == ["start", "resume"]


def test_a_file_that_is_one_torn_line_is_emptied_and_a_long_unended_text_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "lo')
    append_line(path, b'{"step": 1}\n')
    assert _lines(path) == [{"step": 1}]
    other = tmp_path / "other.jsonl"
    other.write_bytes(b"x" * (2 << 20))  # no newline in the last MiB: not a torn line of ours; kept, ended
    append_line(other, b'{"a": 1}\n')
    assert other.read_bytes().endswith(b"x\n" + b'{"a": 1}\n') and other.stat().st_size == (2 << 20) + 10
