"""train_config.adamw: the torch trainers' optimizer decays the weight matrices only, as Megatron-core's does."""

from __future__ import annotations

import torch

from rlslurm.modelspec import ModelConfig
from rlslurm.tinymodel import build_model
from rlslurm.train_config import TrainConfig, adamw


def _step_with_zero_grads(train: TrainConfig) -> tuple[dict, dict]:
    model = build_model(ModelConfig(), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = adamw(model, train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # no gradient: whatever moves, moved by the decay alone
    return before, dict(model.named_parameters())


def test_decay_shrinks_matrices_and_leaves_norms_alone():
    train = TrainConfig(lr=1e-2, weight_decay=0.5)
    before, after = _step_with_zero_grads(train)
    matrices = [n for n, p in before.items() if p.ndim >= 2]
    norms = [n for n, p in before.items() if p.ndim == 1]
    assert matrices and norms  # embeddings, projections; the RMSNorm weights
    for n in matrices:
        torch.testing.assert_close(after[n].detach(), before[n] * (1 - train.lr * train.weight_decay))
    for n in norms:
        assert torch.equal(after[n].detach(), before[n]), n


def test_no_decay_is_one_group_as_older_optimizer_states_hold():
    # a checkpoint saved with one parameter group must still load into a run that decays nothing
    model = build_model(ModelConfig(), seed=0)
    groups = adamw(model, TrainConfig(weight_decay=0.0)).param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in adamw(model, TrainConfig(weight_decay=0.1)).param_groups) == \
        len(list(model.parameters()))
