"""One key set per RL step's metrics row, whatever happened in the step (issue 42, docs/metrics.md): a step
whose groups all had zero variance trains nothing and still writes the trainer's keys (`trained: false`,
each 0); a sync SLURM's stop left to the next start still writes the sync's keys (`sync_skipped: true`).

    python -m pytest -q tests/unit/test_step_rows.py      # ~5 s on 2 cores

The run-level check (every row of real runs, one of them near-greedy so most steps have no trainable
sample on any machine) is in tests/integration/test_rl_learns.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from rlslurm.errors import RlslurmError
from rlslurm.rl.experience import Experience, GroupAssembler
from rlslurm.rl.loop import Loop, skipped_sync_metrics, step_record
from rlslurm.rl.objective import UpdateStats
from rlslurm.rundir import RunDir
from rlslurm.sync.protocol import SyncReport
from rlslurm.tasks.arithmetic import Problem

K = 4
PROBLEMS = [Problem(1, "+", 2), Problem(5, "-", 3)]


def _experience(rewards: list[float]) -> Experience:
    """One step of PROBLEMS x K responses with `rewards` (prompt-major), through the controller's assembler."""
    assembler = GroupAssembler(PROBLEMS, K, lambda text: [1, 5, 15, 6, 17])
    assembler.add_choices([{"engine": 0, "index": i, "prompt_index": i // K, "token_ids": [5 + i % 2, 2],
                            "token_logprobs": [-1.0, -1.0], "policy_version": 0} for i in range(len(rewards))])
    assembler.add_rewards({f"0:{i}": r for i, r in enumerate(rewards)})
    samples, dropped = assembler.samples()
    stats = {"rollout_s": 0.1, "reward_s": 0.01, "samples": len(rewards), "effective_samples": len(samples),
             "zero_variance_groups": dropped}
    return Experience(samples, stats, {0: len(rewards)})


def _row(exp: Experience, stats: dict, sync: dict) -> dict:
    return step_record(exp, stats, 0.2, sync, 0.05, step_s=0.4, step=1, version=1)


def _synced() -> dict:
    """What Controller.sync_weights returns (its report's keys and the wait for the rollout), and the loop's flag."""
    return {**SyncReport(transport="disk", version=1, step=1, attempts=1).metrics(), "sync_wait_rollout_s": 0.01,
            "sync_skipped": False}


def test_a_step_whose_groups_all_have_zero_variance_writes_the_trained_steps_keys(policy_and_guard):
    policy, guard = policy_and_guard
    idle_exp = _experience([1.0] * K + [0.0] * K)  # each group all right or all wrong: nothing to learn
    assert idle_exp.samples == [] and idle_exp.stats["zero_variance_groups"] == 2
    idle = policy.update(idle_exp.samples, guard, step_total=len(idle_exp.samples))
    trained_exp = _experience([1.0, 0.0] * K)
    trained = policy.update(trained_exp.samples, guard, step_total=len(trained_exp.samples))
    assert set(idle) == set(trained) == set(UpdateStats().result())
    assert (idle["trained"], trained["trained"]) == (False, True)
    # Each trainer key of an idle step is its value over no token and no optimizer step (docs/metrics.md).
    assert {k: v for k, v in idle.items() if k != "trained"} == {
        "loss": 0.0, "kl": 0.0, "mini_batches": 0, "tokens": 0, "engine_trainer_logprob_gap": 0.0,
        "engine_trainer_logprob_mismatch": 0.0, "clip_fraction": 0.0, "stale_logprob_drift": 0.0, "grad_norm": 0.0,
        "tis_weight_mean": None, "tis_capped_fraction": None}
    assert trained["tokens"] > 0 and trained["grad_norm"] > 0 and trained["mini_batches"] == 1
    assert set(_row(idle_exp, idle, _synced())) == set(_row(trained_exp, trained, _synced()))


class _Controller:
    """Rank 0's controller as Loop._sync uses it: a sync that passes, or one that fails as SLURM stops the job."""

    def __init__(self, fails: bool):
        self.fails = fails

    def sync_weights(self, weights, *, step: int, version: int, guard) -> dict:
        if self.fails:
            raise RlslurmError("engine 0: connection refused (its node's slurmstepd stopped it)")
        return {k: v for k, v in _synced().items() if k != "sync_skipped"}


@pytest.mark.parametrize("stopped", [False, True], ids=["synced", "stopped-by-slurm"])
def test_a_sync_slurm_stops_writes_the_synced_steps_keys(policy_and_guard, tmp_path, stopped):
    policy, guard = policy_and_guard
    job = dataclasses.replace(policy.job, rl=dataclasses.replace(policy.job.rl, max_staleness=0))
    loop = Loop(job, RunDir(tmp_path / "run").create(), None, SimpleNamespace(signal_name="SIGTERM"),
                guard, policy, _Controller(fails=stopped), None, step=1, version=1)
    metrics, _ = loop._sync()
    assert metrics["sync_skipped"] is stopped
    assert set(metrics) | {"sync_s"} == set(_synced())
    if stopped:
        assert metrics == skipped_sync_metrics()
        assert all(v == 0 for k, v in metrics.items() if k != "sync_skipped")
        exp = _experience([1.0, 0.0] * K)
        assert set(_row(exp, {}, metrics)) == set(_row(exp, {}, _synced()))
