"""JSON that may be hostile (rlslurm/safejson.py), issue 37: 100,000 levels of nesting and a 100,000-digit integer
are a named error, never a RecursionError or ValueError traceback: in the reader itself, in vLLM's gate
(rollout/bounds.py, a 400 instead of vLLM's 500; the server runs in tests/vllm/test_vllm_bounds.py), and in
`rlslurm score`'s responses file (the data files of validate and submit: tests/unit/test_data_refusals.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rlslurm import safejson
from rlslurm.cli.main import cli
from rlslurm.errors import ResponsesError
from rlslurm.reward.offline import read_responses
from rlslurm.rollout.bounds import Bounds

DEEP = "[" * 100_000 + "]" * 100_000
DIGITS = "9" * 100_000


@pytest.mark.parametrize("text, named", [
    (DEEP, "nested deeper than 64 levels"),
    ('{"a": ' + "[" * 65 + "]" * 65 + "}", "nested deeper than 64 levels"),
    (DIGITS, "an integer longer than 4300 digits"),
    ('{"n": -' + DIGITS + "}", "an integer longer than 4300 digits"),
])
def test_past_a_bound_is_a_named_error(text, named):
    with pytest.raises(safejson.JSONLimitError, match=named):
        safejson.loads(text)


def test_within_the_bounds_json_reads_as_json_does():
    text = json.dumps({"a": [[{"b": [1, 2.5, None, True, "x"]}]] * 3, "n": 10 ** 300})
    assert safejson.loads(text) == json.loads(text)
    assert safejson.loads("[" * 64 + "]" * 64) == json.loads("[" * 64 + "]" * 64)
    assert safejson.loads('{"a": 1, "a": 2}') == {"a": 2}  # a data row keeps json's rule...
    with pytest.raises(safejson.JSONLimitError, match="names 'a' twice"):  # ...a request body does not
        safejson.loads('{"a": 1, "a": 2}', strict=True)
    with pytest.raises(safejson.JSONLimitError, match="NaN"):
        safejson.loads('{"n": NaN}', strict=True)
    with pytest.raises(json.JSONDecodeError):
        safejson.loads('{"a": ')


def test_the_gate_refuses_hostile_json_itself_instead_of_handing_it_to_vllm():
    bounds = Bounds()
    assert "nested deeper" in bounds.check(('{"prompt": ' + DEEP + "}").encode(), "completion")
    assert "digits" in bounds.check(('{"prompt": "a", "n": ' + DIGITS + "}").encode(), "any")
    assert bounds.check(b'{"prompt": "a", "n": 2}', "completion") is None
    assert bounds.check(b"no json", "completion") is None  # vLLM's own 400 names what is wrong


@pytest.mark.parametrize("line, named", [
    ('{"row": 0, "response": ' + DEEP + "}", "nested deeper than 64 levels"),
    ('{"row": ' + DIGITS + ', "response": "x"}', "an integer longer than 4300 digits"),
])
def test_a_hostile_responses_line_is_named_by_file_and_line(tmp_path, line, named):
    path = tmp_path / "r.jsonl"
    path.write_text('{"row": 0, "response": "19"}\n' + line + "\n")
    with pytest.raises(ResponsesError, match=f"r.jsonl:2: the line .*{named}"):
        read_responses(path, rows=5)


def test_rlslurm_score_names_a_hostile_responses_file_without_a_traceback(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                              for i in range(4)))
    data = tmp_path / "d.jsonl"
    (tmp_path / "job.yaml").write_text(f"job: {{kind: rl}}\ndata: {{train: {data}, eval: {data}}}\n"
                                       "reward: {scorer: rule, service: local}\n")
    (tmp_path / "r.jsonl").write_text('{"row": 0, "response": ' + DEEP + "}\n")
    result = CliRunner().invoke(cli, ["score", str(tmp_path / "job.yaml"), "--responses", str(tmp_path / "r.jsonl")],
                                catch_exceptions=False)
    assert result.exit_code == ResponsesError.exit_code, result.output
    assert "Traceback" not in result.output and "nested deeper than 64 levels" in result.output, result.output
