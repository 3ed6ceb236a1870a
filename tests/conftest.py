"""Shared test fixtures. Tiers: unit (pure), cluster (the real local Slurm), gpu (skipped on CPU)."""

from __future__ import annotations

import pytest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def pytest_collection_modifyitems(config, items):
    has_gpu = bool(torch is not None and torch.cuda.is_available())
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
