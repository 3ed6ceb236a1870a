"""The planner chooses by the numbers (issue 17): among the options the job can run (each split,
colocation, each sync method) the fastest; a colocation that needs training-state offload is shown with
its figures and never chosen (the runtime cannot run it); `plan` exits 3 when its pre-flight refuses;
every broken parallel rule is listed at once; the recompute mode moves both memory and step time.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlslurm.cli.main import cli
from rlslurm.config import JobConfig, load_config
from rlslurm.configfile import load_mapping
from rlslurm.errors import ConfigError
from rlslurm.plan.parallel import ParallelConfig, static_rules, world_rules
from rlslurm.plan.render import render_json, render_text
from rlslurm.plan.report import build_plan, preflight

ROOT = Path(__file__).resolve().parents[2]
LECTURE = ROOT / "examples" / "lecture-h20.yaml"

# The case: a dense 1B model on 2 x 8 H100, timing at its defaults (1 s train step on 16 GPUs,
# 1 s rollout). The plan used to give rollout a node of its own (memory alone allowed it) at 3.11 s/step
# while its own table showed colocation with ipc at 2.02 s/step, fitting without offload.
DENSE_1B = """
job: {name: dense-1b, kind: rl}
hardware: {profile: h100-80g, nodes: 2, gpus_per_node: 8}
model: {name: dense-1b, layers: 16, hidden: 2048, heads: 16, kv_heads: 8, ffn_hidden: 8192, vocab: 32000,
        max_positions: 4096}
parallel: {seq_len: 4096, micro_batch_size: 1}
memory: {recompute: selective}
placement: {mode: auto}
rollout: {tp: 1, max_seq_len: 4096}
sync: {method: auto}
reward: {service: local}   # a reward service at reward.latency_s (the task's rule inline plans no reward phase)
timing: {train_step_s: 1.0, rollout_s: 1.0}   # measured figures: this file tests the choice, not the counts
"""


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _plan(path: Path, *overrides: str):
    result = CliRunner().invoke(cli, ["plan", str(path), *overrides])
    return result.exit_code, result.stdout, result.stderr


def test_colocation_that_fits_and_is_faster_is_chosen_with_both_step_times(tmp_path):
    # In turn, as the issue timed it (at the default rl.max_staleness 1: tests/unit/test_plan_overlap.py).
    job = load_config(_write(tmp_path, DENSE_1B + "rl: {max_staleness: 0}\n"))
    plan = build_plan(job)
    assert plan.colocate.fits_without_offload
    rows = {(o.placement, o.split.rollout_nodes, o.method): o for o in plan.options}
    colocated, separate = rows["colocate", 0, "ipc"], rows["separate", 1, "broadcast"]
    assert colocated.step.total_s == pytest.approx(2.02, abs=0.005)
    assert separate.step.total_s == pytest.approx(3.11, abs=0.005)
    assert (plan.placement, plan.sync_method, plan.chosen.train_gpus) == ("colocate", "ipc", 16)
    assert preflight(plan) == []
    runner_up, faster = plan.alternatives()
    assert faster is None and runner_up is separate
    # The memory-only advice still says what could leave training; the choice is the step time.
    assert plan.recommended_rollout_nodes == 1

    code, out, _ = _plan(tmp_path / "job.yaml")
    assert code == 0, out
    assert re.search(r"colocate +0 +ipc .* 2\.02 .* ok  <- chosen", out), out
    assert re.search(r"separate +1 +broadcast .* 3\.11 .* ok", out), out
    assert ("chosen: colocate, ipc sync, 16 training GPUs: 2.02 s/step, "
            "the fastest allowed option the job can run") in out
    assert "next: separate, 1 rollout node(s), broadcast sync: 3.11 s/step (+1.09 s, +53.7 %)" in out
    data = json.loads(render_json(plan))
    assert data["chosen"]["step_s"] == pytest.approx(2.02, abs=0.005)
    steps = {(o["placement"], o["rollout_nodes"], o["sync_method"]): o["total_s"] for o in data["options"]}
    assert steps["separate", 1, "broadcast"] == pytest.approx(3.11, abs=0.005)


def test_colocation_needing_offload_is_shown_never_chosen_and_refused_when_asked_for():
    plan = build_plan(load_config(LECTURE))
    colocated = [o for o in plan.options if o.placement == "colocate"]
    ipc = next(o for o in colocated if o.method == "ipc")
    # Faster on paper (381.2 s against 412.8 s), but nothing in the runtime moves trainer state to host RAM.
    assert ipc.step.total_s < plan.option.step.total_s and ipc.not_yet and ipc.status == "not runnable yet"
    assert ipc.step.offload_s == pytest.approx(1.19, abs=0.01)
    assert plan.placement == "separate"
    runner_up, faster = plan.alternatives()
    # sync.method auto is broadcast where separate (SyncConfig.resolved_method): the next is 2 nodes of it.
    assert faster is ipc and (runner_up.placement, runner_up.split.rollout_nodes, runner_up.method) == (
        "separate", 2, "broadcast")
    text = render_text(plan)
    assert re.search(r"colocate +0 +ipc .* 381\.2 .* not runnable yet", text), text
    assert "faster but not runnable yet: colocate, ipc sync: 381.2 s/step (-31.59 s)" in text
    assert "next: separate, 2 rollout node(s), broadcast sync: 462.8 s/step (+50.00 s, +12.1 %)" in text

    job = plan.job
    forced = dataclasses.replace(job, placement=dataclasses.replace(job.placement, mode="colocate"),
                                 reward=dataclasses.replace(job.reward, service="local", partition=None))
    problems = [p for p in preflight(build_plan(forced)) if not p.startswith(("parallel.ep", "model.experts"))]
    assert len(problems) == 1 and "does not do yet" in problems[0] and "placement.mode: separate" in problems[0]


def test_plan_exits_3_on_a_refused_split_after_printing_the_whole_plan():
    code, out, err = _plan(LECTURE, "--set", "placement.mode=separate", "--set", "placement.rollout_nodes=3",
                           "--set", "rollout.engines=3")
    assert code == 3, (out, err)
    assert "Trainer memory per GPU" in out and "checkpoint (C = 490 s" in out  # the whole plan, then the verdict
    assert "preflight: REFUSE: separate, 16 training GPUs: trainer OOM, peak 101.5 GB > 96 GB" in out
    # 3: the OOM, and the two things rlslurm's Megatron trainer does not run yet (EP 8, MoE)
    assert "pre-flight refuses this job (3 problem(s)" in err

    code, out, err = _plan(LECTURE, "--json", "--set", "placement.mode=separate", "--set",
                           "placement.rollout_nodes=3", "--set", "rollout.engines=3")
    assert code == 3 and "preflight_problems" in err
    assert "trainer OOM" in json.loads(out)["preflight_problems"][2]
    assert _plan(LECTURE)[0] == 3  # EP 8 and MoE: planned, not runnable by rlslurm's trainers yet


BROKEN = """
job: {name: broken, kind: rl}
hardware: {profile: h100-80g, nodes: 2, gpus_per_node: 8}
model: {layers: 40, hidden: 1536, heads: 12, kv_heads: 12, ffn_hidden: 4096, vocab: 32000}
parallel: {tp: 3, pp: 3, cp: 2, seq_len: 102}
rollout: {tp: 1}
"""


def test_three_broken_rules_are_listed_at_once(tmp_path):
    rules = static_rules(ParallelConfig(tp=3, pp=3, cp=2, seq_len=102), layers=40, heads=12, kv_heads=12,
                         experts=0, gpus_per_node=8)
    assert [r.keys[0] for r in rules] == ["parallel.cp", "parallel.tp", "parallel.pp"]
    code, out, err = _plan(_write(tmp_path, BROKEN))
    assert code == ConfigError.exit_code, (out, err)
    for fragment in ("3 parallel rules are broken",
                     "(1) 2 x parallel.cp = 4 does not divide parallel.seq_len = 102",
                     "(2) parallel.tp = 3 must divide hardware.gpus_per_node = 8",
                     "(3) parallel.pp = 3 does not divide model.layers = 40"):
        assert fragment in err, (fragment, err)


def test_world_rules_list_the_dense_and_the_expert_grid_together():
    broken = world_rules(ParallelConfig(tp=2, cp=3, ep=4), 20)
    assert len(broken) == 2
    assert "TP x PP x CP = 2 x 1 x 3 = 6 does not divide 20 training GPUs" in broken[0].message
    assert "ETP x EP x PP = 2 x 4 x 1 = 8 does not divide 20 training GPUs" in broken[1].message
    # A split the plan tabulates with both broken shows both, and its pre-flight names both.
    job = load_mapping(JobConfig, {"hardware": {"profile": "h100-80g", "nodes": 2, "gpus_per_node": 10},
                                   "model": {"experts": 8, "topk": 2, "heads": 4},
                                   "parallel": {"tp": 2, "cp": 3, "ep": 4, "seq_len": 96},
                                   "placement": {"mode": "auto"}})
    problems = preflight(build_plan(job))
    assert sum("does not divide 20 training GPUs" in p for p in problems) == 2, problems


@pytest.fixture(scope="module")
def recompute_plans() -> dict:
    """The lecture at 32 training GPUs with fused CE (question 1a), under each recompute mode. Its
    activations and step were measured under full recompute (memory.measured_recompute: full)."""
    base = load_config(LECTURE)
    out = {}
    for mode in ("full", "selective", "none"):
        job = dataclasses.replace(base, memory=dataclasses.replace(base.memory, recompute=mode, fused_ce=True),
                                  placement=dataclasses.replace(base.placement, mode="separate", rollout_nodes=1))
        out[mode] = build_plan(job)
    return out


def test_recompute_moves_memory_and_step_time_as_question_1b_reasons(recompute_plans):
    full, selective, none = (recompute_plans[m].chosen for m in ("full", "selective", "none"))
    # question 1a: 75.28 GB + the fused path's own working set (one chunk's logits, 0.08 GB)
    assert full.memory.peak.value == pytest.approx(75.36, abs=0.01)
    assert full.train_step.value == pytest.approx(150)
    # selective keeps attention's inputs and the MLP's: + 11.3 GB, still under 96 GB (tight)...
    assert selective.memory.peak.value - full.memory.peak.value == pytest.approx(11.29, abs=0.01)
    assert selective.verdict == "tight"
    # ... and redoes attention's core instead of the whole forward: 150 s -> 122 s (the lecture's "saves
    # 25 %" is full's 1/3 with nothing but layers: 150 x 3/4 = 112.5 s; the shape's LM head and what
    # selective still redoes leave 18.6 %).
    assert selective.train_step.value == pytest.approx(150 * 1.0622 / 1.3045, rel=1e-3)
    assert 0.15 < 1 - selective.train_step.value / full.train_step.value < 0.25
    # none: fastest, and its attention scores of 4096 x 4096 per head no longer fit.
    assert none.train_step.value < selective.train_step.value and none.verdict == "OOM"
    # With fused CE and selective recompute every GPU's peak leaves the engine room: colocation runs without
    # offload and is faster (357.7 s against 384.9 s); the config pins separate, and the plan says so.
    plan = recompute_plans["selective"]
    _, faster = plan.alternatives()
    assert (faster.placement, faster.method, faster.runnable) == ("colocate", "ipc", True)
    assert plan.excluded_by(faster) == "placement.mode = 'separate'"
    assert faster.step.total_s == pytest.approx(357.7, abs=0.05) and plan.option.step.total_s == pytest.approx(
        384.9, abs=0.05)
    explain = render_text(plan, explain=True)
    assert "faster but excluded by placement.mode = 'separate': colocate, ipc sync: 357.7 s/step" in explain
    assert "recompute full = 1 + 40 layers' forward" in explain
    assert "train step = timing.train_step_s 120 s x 40 GPUs / 32 GPUs x recompute selective 1.062 / recompute " \
           "full 1.305" in explain
    assert "(calibrated at recompute full) + layers at selective 11.96 GB - layers at full 0.67 GB" in explain


def test_recompute_measured_as_configured_changes_nothing():
    plan = build_plan(load_config(LECTURE))
    assert plan.recompute[-1].value == 1.0
    assert plan.chosen.train_step.how == "timing.train_step_s 120 s x 40 GPUs / 32 GPUs"
