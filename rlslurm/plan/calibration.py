"""A plan calibrated from a run: each term the run measured, as measured / planned, scales the same term of
another job's plan (the seed's checklist: run small first, 1 train node + 1 rollout node, then the full job).

    cal = Calibration.from_figures(run, figures)     # rlslurm/plan_vs_run.py reads a run's figures
    plan = build_plan(bigger_job, calibration=cal)   # `rlslurm plan bigger.yaml --from-run RUN`

What a run measures and how it carries to another shape:
  train        measured / planned train seconds: the device's effective FLOP/s (and op floor) on this model
  rollout      measured / planned rollout seconds: the engine's effective decode speed
  activations  (measured peak - planned resident) / planned activations: the activation count's error (sequence
               lengths the run really had, kernels' temporaries), applied to the new shape's count
  reward       seconds per scored response: reward_s / responses (latency and concurrency as the service ran)
  sync         measured - planned sync seconds: the protocol's round trips beside the bytes (added per step)
  idle         step seconds outside the four phases (the experience broadcast, bookkeeping); for a run whose plan
               overlapped experience and training (rl.max_staleness >= 1), outside max(rollout + reward, train) + sync
  effective    the share of samples that reached the loss with a non-zero advantage
  checkpoint   seconds of one checkpoint, scaled by the parameter count
Whatever a run did not measure stays computed; `assumed()` names it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

TERMS = ("train", "rollout", "activations", "reward_s_per_response", "sync_overhead_s", "idle_s", "effective_share",
         "checkpoint_s_per_gparam")


@dataclass(frozen=True)
class Calibration:
    """Measured constants of one run (None: the run did not measure it)."""

    run: str
    """The run directory the figures come from."""
    train: float | None = None
    """Measured / planned train seconds per step."""
    rollout: float | None = None
    """Measured / planned rollout seconds per step."""
    activations: float | None = None
    """(Measured trainer peak - planned resident) / planned activations."""
    reward_s_per_response: float | None = None
    """Reward seconds per response, as the run's service scored them."""
    sync_overhead_s: float | None = None
    """Sync seconds beyond the planned bandwidth time: the protocol's round trips (DRAIN/UPDATE/VERIFY/RESUME)."""
    idle_s: float | None = None
    """Step seconds outside rollout, reward, train and sync."""
    effective_share: float | None = None
    """Samples with a non-zero advantage / samples."""
    checkpoint_s_per_gparam: float | None = None
    """Seconds of one checkpoint per billion parameters."""

    def measured(self) -> list[str]:
        return [name for name in TERMS if getattr(self, name) is not None]

    def assumed(self) -> list[str]:
        return [name for name in TERMS if getattr(self, name) is None]

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_figures(run: str, planned: dict, measured: dict, *, responses: int, params: float,
                     lengths_vary: bool = False) -> "Calibration":
        """From the run's planned and measured figures (rlslurm/plan_vs_run.py `figures`): each a float or
        None; `responses` per step and `params` of the run's model. `lengths_vary` (RL: a response ends at its
        EOS): the plan's activations are counted at the longest sequence, the run's at the lengths its metered
        steps drew, so the run may raise that count, never lower it: measured on the demo, a small run's step 1
        gave 0.63 of the count and the 2x-prompts run's step 1, longer, 0.77 (peaks 0.0133 / 0.0158 GB)."""

        def ratio(key: str) -> float | None:
            p, m = planned.get(key), measured.get(key)
            return m / p if p and m is not None and p > 0 else None

        activations = None
        if measured.get("trainer_peak_gb") is not None and planned.get("activations_gb"):
            activations = max(0.0, measured["trainer_peak_gb"] - planned["resident_at_peak_gb"]) \
                / planned["activations_gb"]
            if lengths_vary:
                activations = max(1.0, activations)
        reward = measured.get("reward_s")
        sync_m, sync_p = measured.get("sync_s"), planned.get("sync_s")
        step, phases = measured.get("step_s"), [measured.get(f"{p}_s") for p in ("rollout", "reward", "train", "sync")]
        idle = None
        if step is not None and None not in phases:
            rollout, reward_s, train, sync = phases
            busy = max(rollout + reward_s, train) if planned.get("overlapped") else rollout + reward_s + train
            idle = max(0.0, step - busy - sync)
        ckpt = measured.get("checkpoint_s")
        return Calibration(
            run=run, train=ratio("train_s"), rollout=ratio("rollout_s"), activations=activations,
            reward_s_per_response=reward / responses if reward is not None and responses else None,
            sync_overhead_s=max(0.0, sync_m - (sync_p or 0.0)) if sync_m is not None else None,
            idle_s=idle,
            effective_share=measured.get("effective_share"),
            checkpoint_s_per_gparam=ckpt / (params / 1e9) if ckpt is not None and params else None)
