"""The pure parts of `reward.scorer: function` and of the code scorer's HumanEval program: the spec, loading
errors (as `rlslurm validate` reports them), verl's arguments from an item, what a return value scores."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from rlslurm.cli.main import cli
from rlslurm.configfile import load_mapping
from rlslurm.data.sample import Sample
from rlslurm.errors import ConfigError
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.function import load_function, split_spec, verl_arguments
from rlslurm.reward.items import Item, item_for
from rlslurm.reward.scorers import code_program
from rlslurm.reward.worker import _score_of


def test_split_spec():
    assert split_spec("r/rewards.py:score_it") == (split_spec("r/rewards.py")[0], "score_it")
    assert split_spec("rewards.py")[1] == "compute_score"


@pytest.mark.parametrize("text, message", [
    (None, "is not a .py file"),
    ("def compute_score(:\n", "importing .* failed: SyntaxError"),
    ("import no_such_module_here\n", "importing .* failed: ModuleNotFoundError"),
    ("def other(a, b, c, extra_info=None):\n    return 1\n", "defines no function 'compute_score'.*other"),
    ("def compute_score(solution):\n    return 1\n", "cannot be called as compute_score\\(data_source"),
])
def test_load_function_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "rewards.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match="reward.function = .*" + message):
        load_function(str(path))


def test_config_requires_a_function_file(tmp_path):
    with pytest.raises(ConfigError, match="reward.function is required when reward.scorer = 'function'"):
        load_mapping(RewardConfig, {"scorer": "function"}, source="job.yaml", key="reward")
    with pytest.raises(ConfigError, match="reward.function = 'nope.py'.*is not a .py file"):
        load_mapping(RewardConfig, {"scorer": "function", "function": "nope.py"}, source="job.yaml", key="reward")


def test_validate_imports_the_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = ("job: {name: f, kind: rl}\nplacement: {mode: colocate}\nhardware: {nodes: 1, gpus_per_node: 1}\n"
           "reward: {scorer: function, service: local, function: rewards.py}\n")
    (tmp_path / "job.yaml").write_text(job)
    (tmp_path / "rewards.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
                                         "\n    return 1.0\n")
    ok = CliRunner().invoke(cli, ["validate", "job.yaml"])
    assert ok.exit_code == 0 and "rewards.py:compute_score imports" in ok.output, ok.output
    (tmp_path / "rewards.py").write_text("raise RuntimeError('needs a GPU')\n")
    bad = CliRunner().invoke(cli, ["validate", "job.yaml"])
    assert bad.exit_code == 2 and "RuntimeError: needs a GPU" in bad.output and "Traceback" not in bad.output


def test_verl_arguments_from_a_verl_row():
    row = Sample(prompt=[{"role": "user", "content": "q"}], reference=["72", "72.0"],
                 extra={"data_source": "openai/gsm8k", "ability": "math", "extra_info": {"split": "train", "index": 3}})
    args = verl_arguments(item_for(row, "#### 72", "0"))
    assert args == {"data_source": "openai/gsm8k", "solution_str": "#### 72", "ground_truth": ["72", "72.0"],
                    "extra_info": {"split": "train", "index": 3}}
    text = verl_arguments(item_for(Sample(prompt="q", reference="[1]", extra={"k": 1}), "r", "1"))
    assert text["ground_truth"] == "[1]" and text["extra_info"] == {"k": 1}  # text stays text; no extra_info: all


@pytest.mark.parametrize("value, score, reason", [
    (True, 1.0, "f"), (3, 3.0, "f"), (-0.5, -0.5, "f"), ({"score": 0.25, "acc": 1}, 0.25, "f: acc=1"),
    ("1.0", None, "returned str '1.0', not a number"), (math.nan, None, "returned nan"),
    (math.inf, None, "returned inf"), (None, None, "returned NoneType"), ({"acc": 1}, None, "without 'score'"),
    (__import__("numpy").bool_(True), 1.0, "f"), (__import__("numpy").float32(0.5), 0.5, "f"),
    (__import__("torch").tensor(2.0), 2.0, "f"), (__import__("torch").tensor([1.0, 2.0]), None, "not a number"),
])
def test_what_a_return_value_scores(value, score, reason):
    got = _score_of(value, "f")
    assert got["score"] == score and reason in got["reason"], got


def test_humaneval_program():
    base = dict(id="0", prompt="def add(a, b):\n    \"\"\"sum\"\"\"\n", tests="def check(candidate):\n"
                "    assert candidate(1, 2) == 3\n", entry_point="add")
    completion = code_program(Item(response="    return a + b\n", **base))
    assert completion == base["prompt"] + "    return a + b\n\n" + base["tests"] + "\ncheck(add)\n"
    fenced = code_program(Item(response="Here:\n```python\ndef add(a, b):\n    return a + b\n```\n", **base))
    assert fenced.startswith("def add(a, b):\n    return a + b\n\n") and "sum" not in fenced
    helper = code_program(Item(response="```python\ndef helper():\n    pass\n```", **base))
    assert helper.startswith(base["prompt"])  # a block that does not define add is a completion like any other
    plain = code_program(Item(id="1", response="```python\nx = 1\n```", tests="assert x == 1"))
    assert plain == "x = 1\n\n\nassert x == 1\n"


def test_humaneval_program_of_a_chat_row():
    """A chat row asks for the function inside a fenced block of its prompt: a completion continues that code,
    and a restated function gets the prompt's imports back."""
    stub = "from typing import List\nimport math\n\n\ndef total(xs: List[int]) -> int:\n    \"\"\"sum\"\"\"\n"
    base = dict(id="0", prompt=f"Complete this function.\n```python\n{stub}```\n", entry_point="total",
                tests="def check(candidate):\n    assert candidate([1, 2]) == 3\n")
    answer = "```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```"
    restated = code_program(Item(response=answer, **base))
    assert restated.startswith("from typing import List\nimport math\ndef total(xs: List[int]) -> int:\n")
    completion = code_program(Item(response="    return sum(xs)\n", **base))
    assert completion.startswith(stub + "    return sum(xs)\n") and "Complete" not in completion


def test_item_for_marks_json_references():
    assert item_for(Sample(prompt="q", reference=[1, 2]), "r", "0").reference_is_json
    assert not item_for(Sample(prompt="q", reference="[1, 2]"), "r", "0").reference_is_json
    assert json.loads(item_for(Sample(prompt="q", reference={"a": 1}), "r", "0").reference) == {"a": 1}
