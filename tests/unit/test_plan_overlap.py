"""The planned step of a job that runs ahead of its trainer (rl.max_staleness >= 1, issue 36): the experience
(rollout + reward) beside training where they have devices of their own or share CPU cores, added up where a GPU
is time-shared or an engine offloaded; and `--from-run` calibrated from such a run predicts it again."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_plan_choice import DENSE_1B  # the dense 1B on 2 x 8 H100, timed: 1 s train on 16 GPUs, 1 s rollout

from rlslurm.cli.main import cli
from rlslurm.config import JobConfig, load_config
from rlslurm.plan.calibration import Calibration
from rlslurm.plan.hardware import HardwareConfig
from rlslurm.plan.render import as_json
from rlslurm.plan.report import build_plan
from rlslurm.plan.steptime import StepSplit
from rlslurm.plan_vs_run import planned

ROOT = Path(__file__).resolve().parents[2]
PINNED = HardwareConfig(cpu_matmul_gflops=50.0, cpu_op_overhead_us=5.0, cpu_copy_gb_s=5.0)


def _options(tmp_path: Path, staleness: int) -> dict:
    path = tmp_path / f"k{staleness}.yaml"
    path.write_text(DENSE_1B + f"rl: {{max_staleness: {staleness}}}\n")
    plan = build_plan(load_config(path))
    return plan, {(o.placement, o.split.rollout_nodes, o.method): o.step for o in plan.options}


def test_separate_engines_overlap_training_and_a_time_shared_gpu_adds_up(tmp_path):
    in_turn, k0 = _options(tmp_path, 0)
    ahead, k1 = _options(tmp_path, 1)
    sep0, sep1 = k0["separate", 1, "broadcast"], k1["separate", 1, "broadcast"]
    assert not sep0.overlapped and sep1.overlapped
    assert sep0.total_s == pytest.approx(sep0.rollout_s + sep0.reward_s + sep0.train_s + sep0.sync_s)
    # 8 training GPUs: train 2 s, the rollout 1 s + reward beside it: the step is train + sync.
    assert sep1.total_s == pytest.approx(max(sep1.rollout_s + sep1.reward_s, sep1.train_s) + sep1.sync_s)
    assert sep1.total_s == pytest.approx(2.09, abs=0.005) and sep0.total_s == pytest.approx(3.11, abs=0.005)
    assert sep1.hidden_s == pytest.approx(sep1.rollout_s + sep1.reward_s)
    # Colocated on the GPUs the engine and the trainer take turns on the same SMs: no overlap is planned.
    colo = k1["colocate", 0, "ipc"]
    assert not colo.overlapped and colo.total_s == pytest.approx(k0["colocate", 0, "ipc"].total_s)
    assert ahead.placement == "colocate"  # 2.02 s still beats 2.09 s
    option = next(o for o in json.loads(as_json(ahead, []))["options"]
                  if (o["placement"], o["sync_method"]) == ("separate", "broadcast"))
    assert option["overlapped"] and option["hidden_s"] == pytest.approx(sep1.hidden_s, abs=1e-5)


def test_an_offloaded_engine_never_overlaps_and_the_lecture_plans_in_turn():
    lecture = load_config(ROOT / "examples" / "lecture-h20.yaml")
    assert lecture.rl.max_staleness == 0  # the lecture's 480 s / 413 s are one phase after the other
    ahead = dataclasses.replace(lecture, rl=dataclasses.replace(lecture.rl, max_staleness=1))
    steps = {(o.placement, o.method): o.step for o in build_plan(ahead).options}
    offloaded = steps["colocate", "ipc"]
    assert offloaded.offload_s > 0 and not offloaded.overlapped
    assert steps["separate", "broadcast"].overlapped
    assert build_plan(ahead).option.step.total_s < build_plan(lecture).option.step.total_s


def test_cpu_cores_overlap_even_colocated_and_the_text_says_how_the_step_adds_up(tmp_path):
    job = dataclasses.replace(JobConfig(), hardware=PINNED)
    assert job.hardware.profile == "cpu" and job.rl.max_staleness == 1
    step = build_plan(job).option.step
    assert step.overlapped and step.total_s == pytest.approx(
        max(step.rollout_s + step.reward_s, step.train_s) + step.sync_s + step.offload_s + step.idle_s)
    path = tmp_path / "cpu.yaml"
    path.write_text("job: {name: cpu, kind: rl}\nrl: {max_staleness: 2}\n")
    out = CliRunner().invoke(cli, ["plan", str(path)]).stdout
    assert "rl.max_staleness 2: separate or on CPU cores, a step is max(rollout + reward, train) + sync" in out, out
    path.write_text("job: {name: cpu, kind: rl}\nrl: {max_staleness: 0}\n")
    assert "rl.max_staleness" not in CliRunner().invoke(cli, ["plan", str(path)]).stdout


def test_the_idle_of_an_overlapped_run_is_what_the_longer_side_and_the_sync_leave():
    # The demo at k = 1 on 2 cores (bench_vs_trl, quiet): rollout 0.107, train 0.114 side by side, step 0.144.
    measured = {"rollout_s": 0.107, "reward_s": 0.0, "train_s": 0.114, "sync_s": 0.014, "step_s": 0.144}
    plan = {"rollout_s": 0.015, "reward_s": 0.0, "train_s": 0.2, "sync_s": 1e-5, "step_s": 0.2}
    ahead = Calibration.from_figures("r", {**plan, "overlapped": True}, measured, responses=512, params=1e5)
    assert ahead.idle_s == pytest.approx(0.144 - 0.114 - 0.014)
    # In turn the same figures would leave no idle at all (their sum is over the step): the plan's model decides.
    assert Calibration.from_figures("r", plan, measured, responses=512, params=1e5).idle_s == 0.0
    # And the step rebuilt from the calibrated terms is the measured one.
    rebuilt = StepSplit("broadcast", "separate", measured["rollout_s"], 0.0, measured["train_s"], measured["sync_s"],
                        0.0, ahead.idle_s, overlapped=True)
    assert rebuilt.total_s == pytest.approx(measured["step_s"])


def test_the_plan_json_of_a_run_says_whether_its_step_overlapped():
    job = dataclasses.replace(JobConfig(), hardware=PINNED)
    data = json.loads(as_json(build_plan(job), []))
    assert planned(data, "rl")["overlapped"] is True
    in_turn = dataclasses.replace(job, rl=dataclasses.replace(job.rl, max_staleness=0))
    assert planned(json.loads(as_json(build_plan(in_turn), [])), "rl")["overlapped"] is False


def test_the_tasks_rule_scored_in_the_controller_plans_no_reward_phase():
    demo = load_config(ROOT / "examples" / "tiny-grpo.yaml")
    assert demo.reward.service == "inline" and demo.data.train is None
    plan = build_plan(demo)
    assert plan.reward.used.value == 0.0 and "scored in the controller" in plan.reward.used.how
    served = load_config(ROOT / "examples" / "tiny-grpo.yaml", ("reward.service=local",))
    planned = 512 * served.reward.latency_s / served.reward.concurrency
    assert build_plan(served).reward.used.value == pytest.approx(planned)
