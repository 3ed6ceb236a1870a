"""The plan's counted step times (rlslurm/plan/compute.py), its calibration from a run (calibration.py), and the
comparison of a plan with a run (rlslurm/plan_vs_run.py) on a run directory written here."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlslurm import events
from rlslurm.config import JobConfig
from rlslurm.logprobs import CausalLMScorer
from rlslurm.modelspec import ModelConfig, param_counts
from rlslurm.plan.calibration import Calibration
from rlslurm.plan.compute import OPS_AROUND, OPS_PER_LAYER, OPS_PER_PARAM_TENSOR, device_speed, train_seconds
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.render import as_json
from rlslurm.plan.report import build_plan
from rlslurm.plan_vs_run import CHECK_STEP, check, plan_vs_measured
from rlslurm.rundir import RunDir
from rlslurm.tinymodel import build_model

# Pinned speeds: the counts, not this machine's measurement, are what these tests hold.
PINNED = HardwareConfig(cpu_matmul_gflops=50.0, cpu_op_overhead_us=5.0, cpu_copy_gb_s=5.0)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_of_one_step(layers: int) -> int:
    model = build_model(ModelConfig(layers=layers), seed=0)
    scorer, opt = CausalLMScorer(model, fused=False), torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 32, (4, 12))

    def step():
        (-scorer(ids, torch.ones_like(ids)).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on
    with _Ops() as ops:
        step()
    return ops.count


def test_the_op_counts_are_the_torch_trainers():
    two, four = _ops_of_one_step(2), _ops_of_one_step(4)
    per_layer = (four - two) / 2  # a layer's forward + backward + its 9 tensors' AdamW updates
    assert per_layer == pytest.approx(OPS_PER_LAYER + 9 * OPS_PER_PARAM_TENSOR, rel=0.1)
    assert two - 2 * per_layer == pytest.approx(OPS_AROUND + 2 * OPS_PER_PARAM_TENSOR, rel=0.25)


def test_train_seconds_are_flops_at_the_speed_plus_ops_at_the_floor():
    job = dataclasses.replace(JobConfig(), hardware=PINNED)
    speed = device_speed(job.hardware, job.timing.mfu)
    assert (speed.flops, speed.op_s) == pytest.approx((50e9, 5e-6))
    counts = param_counts(job.model)
    one, two = (train_seconds(job, counts, dp, speed) for dp in (1, 2))
    assert one.value > two.value > one.value / 2  # half the tokens per rank, the same ops floor
    bigger = dataclasses.replace(job, rl=dataclasses.replace(job.rl, prompts_per_step=job.rl.prompts_per_step * 2))
    assert train_seconds(bigger, counts, 1, speed).value > one.value
    assert "GFLOP/s" in one.how and "ops x 5 us" in one.how


def test_a_calibration_scales_each_term_it_measured_and_nothing_else():
    job = dataclasses.replace(JobConfig(), hardware=PINNED)
    plain = build_plan(job)
    cal = Calibration(run="runs/small", train=2.0, rollout=3.0, activations=0.5, reward_s_per_response=0.001,
                      idle_s=0.05)
    calibrated = build_plan(job, calibration=cal)
    a, b = plain.option.step, calibrated.option.step
    assert b.train_s == pytest.approx(2 * a.train_s) and b.rollout_s == pytest.approx(3 * a.rollout_s)
    assert b.reward_s == pytest.approx(plain.reward.responses * 0.001) and b.idle_s == 0.05
    assert b.sync_s == a.sync_s  # not measured: still counted
    m0, m1 = plain.chosen.memory, calibrated.chosen.memory
    assert m1.resident.value == m0.resident.value
    assert m1.activations.total.value == pytest.approx(0.5 * m0.activations.total.value)
    data = json.loads(as_json(calibrated, []))
    assert data["calibration"]["measured"] == ["train", "rollout", "activations", "reward_s_per_response", "idle_s"]
    assert "checkpoint_s_per_gparam" in data["calibration"]["assumed"]


def _run_dir(tmp_path, job: JobConfig, rows: list[dict]) -> RunDir:
    run = RunDir(tmp_path / "run").create()
    run.plan.write_text(as_json(build_plan(job), []))
    for r in rows:
        run.append_json(run.metrics, r)
    return run


def test_a_run_meets_its_plan_and_names_each_figure_off_by_more_than_ten_percent(tmp_path):
    job = dataclasses.replace(JobConfig(), hardware=PINNED)
    plan = json.loads(as_json(build_plan(job), []))
    chosen = next(o for o in plan["options"] if o["placement"] == plan["chosen"]["placement"]
                  and o["rollout_nodes"] == plan["chosen"]["rollout_nodes"]
                  and o["sync_method"] == plan["chosen"]["sync_method"])
    peak = next(s["peak_gb"] for s in plan["splits"] if s["train_gpus"] == plan["chosen"]["train_gpus"])
    # As planned, but the train phase twice as long (so the step too) and the memory 5 % under.
    row = {k: chosen[k] for k in ("rollout_s", "reward_s", "sync_s")}
    row.update(train_s=2 * chosen["train_s"], samples=512, effective_samples=512)
    row["step_s"] = row["rollout_s"] + row["reward_s"] + row["train_s"] + row["sync_s"]
    row["effective_samples_per_s"] = 512 / row["step_s"]
    rows = [{"step": s, "t": float(s), **row, "trainer_peak_gb": 0.95 * peak if s == 1 else None,
             "trainer_peak_gb_by_rank": [0.95 * peak, 0.9 * peak] if s == 1 else None} for s in range(1, 6)]
    run = _run_dir(tmp_path, job, rows)
    found = {r["figure"]: r for r in plan_vs_measured(run)["rows"]}
    assert found["train_s"]["ratio"] == pytest.approx(2.0) and found["trainer_peak_gb"]["ratio"] == pytest.approx(0.95)
    assert found["rollout_s"]["ratio"] == pytest.approx(1.0)
    off = check(run, CHECK_STEP)
    assert {r["figure"] for r in off} == {"train_s", "step_s", "effective_samples_per_s"}
    said = events.read_events(run, events.PLAN_OFF)
    assert {e["figure"] for e in said} == {r["figure"] for r in off} and all("--from-run" in e["fix"] for e in said)


def test_an_rl_run_may_raise_the_activation_count_but_never_lower_it():
    """RL responses end at their EOS: a small run's metered step may have drawn short ones, the full run's longer
    (the demo: 0.63 and 0.77 of the count at seq_len), so only a count the run exceeded is scaled."""
    planned = {"activations_gb": 0.0171, "resident_at_peak_gb": 0.0026}
    short, long_ = {"trainer_peak_gb": 0.0133}, {"trainer_peak_gb": 0.030}
    kw = dict(responses=512, params=1e5)
    assert Calibration.from_figures("r", planned, short, **kw).activations == pytest.approx(0.626, abs=1e-3)
    assert Calibration.from_figures("r", planned, short, lengths_vary=True, **kw).activations == 1.0
    assert Calibration.from_figures("r", planned, long_, lengths_vary=True, **kw).activations == pytest.approx(
        (0.030 - 0.0026) / 0.0171)
