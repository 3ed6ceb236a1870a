"""Properties of the planner over many random clusters and models (hypothesis)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from rlslurm.config import JobConfig
from rlslurm.configfile import FieldError
from rlslurm.modelspec import ModelConfig
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.memory import MemoryConfig
from rlslurm.plan.parallel import ParallelConfig
from rlslurm.plan.placement import PlacementConfig
from rlslurm.plan.render import render_json, render_text
from rlslurm.plan.report import build_plan, preflight
from rlslurm.rollout.config import RolloutConfig
from rlslurm.train_config import TrainConfig

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])


@st.composite
def jobs(draw) -> JobConfig:
    gpus_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    ep = draw(st.sampled_from([1, 2, 4, 8]))
    experts = draw(st.sampled_from([0, 8, 16, 64]))
    mode = draw(st.sampled_from(["auto", "colocate", "separate"]))
    nodes = draw(st.integers(1, 6))
    try:
        return JobConfig(
            model=ModelConfig(layers=4, hidden=256, heads=8, experts=experts, topk=min(2, experts),
                              expert_params_b=draw(st.floats(0, 60)) if experts else None,
                              dense_params_b=draw(st.floats(0.05, 8))),
            parallel=ParallelConfig(ep=ep, tp=draw(st.sampled_from([1, 2])), seq_len=4096),
            hardware=HardwareConfig(profile=draw(st.sampled_from(["h20-96g", "h100-80g", "a100-80g"])),
                                    nodes=nodes, gpus_per_node=gpus_per_node),
            memory=MemoryConfig(activation_gb=draw(st.one_of(st.none(), st.floats(1, 60))),
                                logits_gb=draw(st.one_of(st.none(), st.floats(0, 10))),
                                fused_ce=draw(st.booleans()),
                                recompute=draw(st.sampled_from(["none", "selective", "full"]))),
            placement=PlacementConfig(mode=mode, offload=draw(st.booleans()),
                                      rollout_nodes=draw(st.one_of(st.none(), st.integers(0, nodes - 1)))),
            rollout=RolloutConfig(tp=draw(st.sampled_from([1, 2]))),
            train=TrainConfig(backend="megatron"),  # the MoE and EP layouts drawn here are Megatron's
        )
    except FieldError:
        assume(False)


@SETTINGS
@given(jobs())
def test_more_training_gpus_never_raise_expert_optimizer_memory(job: JobConfig):
    rows = sorted((s for s in build_plan(job).splits if s.memory is not None), key=lambda s: s.train_gpus)
    for fewer, more in zip(rows, rows[1:]):
        assert more.memory.expert_optimizer.value <= fewer.memory.expert_optimizer.value + 1e-9
        assert more.memory.peak.value <= fewer.memory.peak.value + 1e-9


@SETTINGS
@given(jobs())
def test_peak_is_resident_plus_activations_minus_fused_ce(job: JobConfig):
    for s in build_plan(job).splits:
        if s.memory is None:
            continue
        m = s.memory
        act = m.activations
        # Megatron's peak: everything resident + the activations (less fused CE's saving) + the LM head's
        # weight gradient on its way into the grad buffer (none counted beside a measured activation_gb)
        assert m.peak.value == pytest.approx(m.resident.value + m.peak_activations_gb)
        extra = m.peak_activations_gb - (act.total.value - act.fused_ce_saving.value)
        if job.memory.activation_gb is not None:
            assert extra == pytest.approx(0.0, abs=1e-9)
        else:
            assert extra > 0
        if job.memory.fused_ce:  # the logits go, the fused path's working set (one chunk's logits) comes
            assert 0.0 <= act.fused_ce_saving.value <= act.logits.value
        else:
            assert act.fused_ce_saving.value == 0.0


@SETTINGS
@given(jobs())
def test_a_split_called_oom_is_never_ok_elsewhere(job: JobConfig):
    plan = build_plan(job)
    problems = preflight(plan)
    data = json.loads(render_json(plan))
    table = render_text(plan, explain=False)
    for s, row in zip(plan.splits, data["splits"]):
        if s.verdict != "OOM":
            continue
        assert row["verdict"] == "OOM"
        assert plan.recommended_rollout_nodes != s.rollout_nodes
        assert re.search(rf"^ {s.rollout_nodes} +{s.train_gpus} .* OOM", table, re.M), table
        if s is plan.chosen:
            assert any("trainer OOM" in p for p in problems)
        if s.rollout_nodes == 0:
            assert not plan.colocate.fits_without_offload and not plan.colocate.feasible
    assert (plan.chosen.verdict in ("OOM", "invalid")) <= bool(problems)
