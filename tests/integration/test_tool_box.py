"""The tool box with real worker processes and the real sandbox: a user's tool that raises, hangs past its
timeout, returns megabytes or kills its own worker is a short error back to the model and a counted kind, and
the next call is answered by a fresh worker; a malformed call, an unknown tool and wrong arguments never reach a
tool; `python` runs in the reward sandbox."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlslurm.configfile import load_mapping
from rlslurm.reward.config import SandboxConfig
from rlslurm.rollout.config import RolloutConfig
from rlslurm.tools.calls import Call
from rlslurm.tools.toolbox import Toolbox

TOOLS = Path(__file__).resolve().parents[1] / "data" / "tools" / "hostile_tools.py"
NAMES = ("echo", "boom", "sleepy", "big", "quits", "grade", "lookup")


@pytest.fixture(scope="module")
def box():
    cfg = load_mapping(RolloutConfig, {"max_turns": 2, "tools": ["calculator", *(f"{TOOLS}:{n}" for n in NAMES)],
                                       "tool_timeout_s": 2.0, "tool_output_chars": 1000, "tool_workers": 2})
    box = Toolbox.start(cfg, SandboxConfig())
    yield box
    box.close()


def test_schemas_in_order_from_signatures_docstrings_and_declarations(box):
    names = [s["function"]["name"] for s in box.schemas]
    assert names == ["calculator", *NAMES]
    echo = box.schemas[1]["function"]
    assert echo["description"] == "Say the text back." and echo["parameters"]["required"] == ["text"]
    grade = box.schemas[6]["function"]["parameters"]
    assert list(grade["properties"]) == ["answer"]  # ground_truth is the row's (keyword-only), not the model's
    assert box.schemas[7]["function"]["description"] == "Declared beside the function."
    assert box.first_parameter("calculator") == "expression"


@pytest.mark.parametrize("call, kind, says", [
    (Call(error="the call is not JSON", text="{oops"), "malformed", "not JSON"),
    (Call(name="nope"), "unknown_tool", "no tool 'nope'"),
    (Call(name="echo", arguments={"words": "hi"}), "bad_arguments", "missing argument 'text'"),
    (Call(name="echo", arguments={"text": 3}), "bad_arguments", "must be string"),
    (Call(name="boom"), "raised", "ValueError: the tool broke"),
    (Call(name="sleepy"), "timeout", "rollout.tool_timeout_s = 2 s"),
    (Call(name="big"), "output_limit", "rollout.tool_output_chars = 1000"),
    (Call(name="quits"), "raised", "died"),
    (Call(name="calculator", arguments={"expression": "9**9**9"}), "raised", "digits"),
])
def test_each_hostile_call_is_a_short_error_and_the_next_call_works(box, call, kind, says):
    t = time.monotonic()
    [result] = box.run([call])
    assert result.error == kind and says in result.content, result
    assert len(result.content) <= 200  # short: a megabyte never reaches the model, let alone the trainer
    assert time.monotonic() - t < 2.0 + 3.0  # the hang is cut at the timeout (+ the kill)
    [ok] = box.run([Call(name="echo", arguments={"text": "still here"})])  # a fresh worker where one was killed
    assert (ok.error, ok.content) == (None, "still here")


def test_calls_of_many_episodes_run_at_once(box):
    t = time.monotonic()
    results = box.run_many([([Call(name="sleepy")], None, None), ([Call(name="sleepy")], None, None),
                            ([Call(name="calculator", arguments={"expression": "123*45"})], None, None)])
    assert [r[0].error for r in results] == ["timeout", "timeout", None] and results[2][0].content == "5535"
    assert time.monotonic() - t < 2 * 2.0 + 3.0  # two hangs side by side, not one after the other


def test_row_context_and_offered_tools(box):
    [right], [wrong] = box.run_many([([Call(name="grade", arguments={"answer": "5"})],
                                      {"grade": {"create_kwargs": {"ground_truth": "5"}}}, None),
                                     ([Call(name="grade", arguments={"answer": "5"})], {}, None)])
    assert (right.content, wrong.content) == ("right", "wrong")
    [refused] = box.run([Call(name="echo", arguments={"text": "x"})], offered=["calculator"])
    assert refused.error == "unknown_tool"
    [declared] = box.run([Call(name="lookup", arguments={"key": "abc"})])
    assert declared.content == '{"key": "abc", "value": 3}'


def test_too_many_calls_in_one_turn(box):
    results = box.run([Call(name="echo", arguments={"text": str(i)}) for i in range(10)])
    assert [r.content for r in results[:8]] == [str(i) for i in range(8)]
    assert results[-1].error == "too_many_calls" and len(results) == 9


def test_python_runs_in_the_sandbox(tmp_path):
    cfg = load_mapping(RolloutConfig, {"max_turns": 2, "tools": ["python"], "tool_timeout_s": 3.0})
    box = Toolbox.start(cfg, SandboxConfig())
    try:
        connect = "import socket\nsocket.create_connection(('1.1.1.1', 80))"
        out = box.run([Call(name="python", arguments={"code": "print(6 * 7)"}),
                       Call(name="python", arguments={"code": connect}),
                       Call(name="python", arguments={"code": "while True: pass"}),
                       Call(name="python", arguments={"code": "print('y' * 10**6)"})])
    finally:
        box.close()
    assert (out[0].error, out[0].content.strip()) == (None, "42")
    assert out[1].error is None and "Error" in out[1].content  # no network: the program's own traceback
    assert out[2].error == "timeout" and out[3].error == "output_limit"
