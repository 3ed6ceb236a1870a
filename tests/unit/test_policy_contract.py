"""Both RL policies hold to one contract (rlslurm/rl/policy.py's RLPolicy): the same methods with the same
arguments, and the RL loop and its checkpoints use nothing else of a policy.

The Megatron policy needs a GPU to build, so a call it does not accept (the RL loop's
`update(..., step_total=...)` once was one) would otherwise fail first on a GPU node; here it fails in CI.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rlslurm.megatron.policy import MegatronPolicy
from rlslurm.rl.policy import Policy, RLPolicy

ROOT = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = [Policy, MegatronPolicy]
INTERFACE = set(RLPolicy.__abstractmethods__) | set(RLPolicy.__annotations__)
# The modules that hold a policy: everything they touch of it must be in the interface.
USERS = ["rlslurm/rl/loop.py", "rlslurm/rl/checkpointing.py", "rlslurm/rl/controller.py"]


def _parameters(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_implements_every_method_with_the_interfaces_arguments(cls):
    assert issubclass(cls, RLPolicy)
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
    for name in sorted(RLPolicy.__abstractmethods__):
        assert _parameters(getattr(cls, name)) == _parameters(getattr(RLPolicy, name)), (
            f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} differs from "
            f"RLPolicy.{name}{inspect.signature(getattr(RLPolicy, name))}")


def _policy_attributes(path: Path) -> set[tuple[str, int]]:
    """(attribute, line) for every `policy.X` and `self.policy.X` in the module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "policy") or (
                isinstance(owner, ast.Attribute) and owner.attr == "policy"):
            found.add((node.attr, node.lineno))
    return found


@pytest.mark.parametrize("module", USERS)
def test_the_rl_job_uses_only_the_interface(module):
    used = _policy_attributes(ROOT / module)
    outside = sorted((attr, line) for attr, line in used if attr not in INTERFACE)
    assert not outside, f"{module} uses policy members outside RLPolicy: {outside} (declare them in RLPolicy)"


def test_the_scan_sees_the_loops_calls():
    # The AST scan must find the loop's real calls, or the check above passes vacuously.
    used = {attr for attr, _ in _policy_attributes(ROOT / "rlslurm/rl/loop.py")}
    assert {"update", "served_weights", "model", "tokenizer"} <= used
