"""Shared test fixtures. Tiers: unit (pure), cluster (the real local Slurm), gpu (skipped on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Helpers every tier shares (waiting.py's wait_for) import by their module name from this folder.
sys.path.insert(0, str(Path(__file__).parent))

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


# `make test` runs the suite on two pytest-xdist workers, scheduled by scope (below). The cluster tier is one
# scope, so one worker runs it in order against its one local Slurm: its tests wait on SLURM (requeues,
# KillWait, SlurmdTimeout) more than they compute, and the other worker fills those waits with the rest.
# Every other file is a scope of its own, so a module's shared server (vLLM, the reward service) starts
# once. The tests that scan every process of the machine for the sandbox's uids run in the cluster's scope:
# a sandboxed program of a test running beside them would be what they find.
SERIAL = ("tests/cluster/", "tests/integration/test_reward_sandbox.py", "tests/integration/test_sandbox_escapes.py",
          "tests/unit/test_reward_scorers.py", "tests/integration/test_reward_humaneval.py")
SHARED = {"tests/vllm/test_vllm_serve_sync.py": "tests/vllm/shared-engine",
          "tests/vllm/test_vllm_serving.py": "tests/vllm/shared-engine"}
"""Files that share one session-scoped server (tests/vllm/conftest.py `engine`): one scope, so it starts once."""


def pytest_collection_modifyitems(config, items):
    has_gpu = bool(torch is not None and torch.cuda.is_available())
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with the scopes above. Not `--dist loadgroup`: its xdist_group marks work by
    renaming each test's nodeid, which pytest 9 no longer lets a plugin do (the marks were silently ignored)."""
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return "serial" if path.startswith(SERIAL) else SHARED.get(path, path)

    return Scopes(config, log)


# A skipped cluster test proves nothing, so a run that skipped one fails (issue: "make .ci/run fail if
# they were skipped"). Deselecting them (-m "not cluster") is the explicit way to run without a cluster.
_skipped_cluster_tests: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and "cluster" in report.keywords:
        _skipped_cluster_tests.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _skipped_cluster_tests and exitstatus == 0:
        names = "\n  ".join(_skipped_cluster_tests)
        session.config.get_terminal_writer().line(
            f"FAILED: {len(_skipped_cluster_tests)} cluster test(s) were skipped; the SLURM tests must run:\n  {names}",
            red=True)
        session.exitstatus = 1
