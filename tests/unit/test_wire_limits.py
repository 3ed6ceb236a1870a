"""The limits a request is held to (rollout/batcher.py Limits, pure), the config keys they come from, and
the rule that no module behind a network route unpickles anything."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rlslurm.configfile import load_mapping
from rlslurm.errors import ConfigError
from rlslurm.reward.config import RewardConfig
from rlslurm.rollout.batcher import Limits
from rlslurm.rollout.config import RolloutConfig

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(max_n=4, max_tokens=16, max_prompts=3, max_prompt_tokens=20, max_batch_rows=8,
                context_tokens=30, vocab_size=50)


@pytest.mark.parametrize("prompts, n, max_tokens, named", [
    ([[1]], 5, 1, "max_n = 4 (rollout.max_n)"),
    ([[1]], 1, 17, "limit 16 (rollout.max_new_tokens)"),
    ([[1]] * 4, 1, 1, "max_prompts_per_request = 3"),
    ([[1]] * 3, 3, 1, "3 prompts x n = 3 = 9 sequences are over the engine's limit max_batch_rows = 8"),
    ([[1] * 21], 1, 1, "prompt 0 has 21 tokens, over the engine's limit max_prompt_tokens = 20"),
    ([[1], [1] * 20], 1, 11, "prompt 1 has 20 tokens + max_tokens 11 = 31, over the model's context of 30"),
    ([[1, 50]], 1, 1, "token id 50 is outside the vocabulary [0, 50)"),
    ([[-3]], 1, 1, "token id -3 is outside"),
    ([[1], []], 1, 1, "prompt 1 encodes to zero tokens"),
    ([], 1, 1, "need at least one prompt"),
    ([[1]], 0, 1, "must both be >= 1"),
])
def test_each_limit_is_named(prompts, n, max_tokens, named):
    assert named in LIMITS.check(prompts, n, max_tokens)


def test_requests_within_every_limit_pass():
    assert LIMITS.check([[1] * 20, [49], [0]], 2, 10) is None
    assert Limits().check([[7] * 10_000], 64, 1024) is None  # no model facts: no context or vocabulary bound


def test_the_engine_limits_default_to_what_the_job_asks_for():
    args = RolloutConfig(max_new_tokens=12).server_args(samples_per_prompt=8, prompts_per_request=32,
                                                        eval_prompts=200)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags == {"--max-n": "8", "--max-tokens": "12", "--max-prompts": "200", "--max-batch-rows": "256",
                     "--request-timeout-s": "120", "--stall-timeout-s": "60", "--max-body-mb": "16"}
    opened = RolloutConfig(max_n=2, max_prompt_tokens=64, open_data_plane=True).server_args(
        samples_per_prompt=8, prompts_per_request=1, eval_prompts=1)
    assert opened[-1] == "--open-data-plane" and opened[opened.index("--max-n") + 1] == "2"
    assert opened[opened.index("--max-prompt-tokens") + 1] == "64"


@pytest.mark.parametrize("cls, section, data, words", [
    (RolloutConfig, "rollout", {"max_n": 0}, "rollout.max_n"),
    (RolloutConfig, "rollout", {"stall_timeout_s": 0}, "rollout.stall_timeout_s"),
    (RewardConfig, "reward", {"batch_size": 64, "max_items_per_request": 32}, "reward.max_items_per_request = 32"),
    (RewardConfig, "reward", {"max_item_bytes": 10}, "reward.max_item_bytes"),
])
def test_bad_limits_are_config_errors(cls, section, data, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_mapping(cls, data, source="job.yaml", key=section)


NETWORK_FACING = ["rlslurm/rollout", "rlslurm/sync", "rlslurm/reward", "rlslurm/wire.py", "rlslurm/secret.py"]
EXECUTABLE_MODULES = {"pickle", "dill", "cloudpickle", "marshal", "shelve"}
EXECUTABLE_CALLS = {"eval", "exec", "pickle.load", "pickle.loads", "torch.load", "Unpickler", "pickle.Unpickler",
                    "ForkingPickler", "marshal.loads"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def executable_formats(source: str) -> list[str]:
    """Imports of a deserialiser that runs code, and calls of one or of eval/exec, in the code itself (a
    program text that the code scorer hands to the sandbox is data here, and is not counted)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            hits += [f"import {n}" for n in names if n.split(".")[0] in EXECUTABLE_MODULES]
        elif isinstance(node, ast.Call) and _dotted(node.func) in EXECUTABLE_CALLS:
            hits.append(f"{_dotted(node.func)}(")
    return hits


def test_the_scan_finds_what_it_forbids():
    found = executable_formats("import pickle\nx = pickle.loads(b)\neval('1')\nfrom dill import loads\n")
    assert sorted(found) == sorted(["import pickle", "pickle.loads(", "eval(", "import dill"])
    assert executable_formats("RUNNER = 'exec(compile(src))'\n") == []


def test_no_module_behind_a_network_route_unpickles_or_evaluates():
    files = [p for entry in NETWORK_FACING for p in ((REPO / entry).rglob("*.py") if (REPO / entry).is_dir()
                                                     else [REPO / entry])]
    assert len(files) > 15
    hits = [f"{p.relative_to(REPO)}: {hit}" for p in files for hit in executable_formats(p.read_text())]
    assert hits == []
