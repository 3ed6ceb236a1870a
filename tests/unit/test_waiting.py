"""The tests' one polled wait (tests/waiting.py), importable from every tier."""

from __future__ import annotations

import itertools

import pytest

from waiting import wait_for


def test_returns_the_first_truthy_value_and_runs_on_poll_at_its_pace():
    values = iter([None, [], 0, ["ckpt"]])
    kicks = []
    assert wait_for("a checkpoint", lambda: next(values), 5, poll_s=0.01, on_poll=lambda: kicks.append(1),
                    on_poll_every_s=0.0) == ["ckpt"]
    assert len(kicks) == 3  # once per failed poll at pace 0


def test_times_out_naming_what_it_waited_for_and_the_last_value():
    count = itertools.count()
    kicks = []
    with pytest.raises(AssertionError, match=r"timed out after 0.3 s waiting for step 9 \(last value: False\)"):
        wait_for("step 9", lambda: next(count) > 10**9, 0.3, poll_s=0.01, on_poll=lambda: kicks.append(1),
                 on_poll_every_s=10)
    assert kicks == []  # never due within 0.3 s
