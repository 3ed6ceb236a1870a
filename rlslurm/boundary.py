"""The step boundary: where every rank of a training loop agrees to go on, checkpoint, stop or drain, in one place.

    boundary = StepBoundary(run, topo, gate, job, start_step=step)   # after the start's resume
    while True:
        at = boundary.agree(step, stop=target_reached)      # collective: every rank, every boundary
        if at.drain:
            return boundary.drain(step, at, save)            # collective: checkpoint, requeue, DRAINED
        if at.checkpoint_due:
            save()                                           # then boundary.interval.observe_save(...)
        if at.stop or step >= steps:
            break
        ...one step...                                       # then boundary.interval.observe_step(seconds)

The SFT (jobs/sft.py), toy (jobs/toytrain.py) and RL (rlslurm/rl/loop.py) loops call it, so drain and resume, the
project's central promise, is written once. `agree` all-reduces (MAX) one flag tensor over the default group: a
drain asked of any rank (signal or control file, diag/drain_gate.py), the least KillWait left after a SIGTERM,
rank 0's checkpoint interval (rlslurm/checkpoint.py IntervalPolicy, capped by the SLURM allocation's time limit),
and the loop's own reason to stop (SFT's dev target): every rank decides the same at the same step. `drain`
gathers every rank's reason, lets the loop drain what it runs beside the trainer (the RL engines), checkpoints if
KillWait still fits it and requeues through the leader (rlslurm/lifecycle.py finish_drain), and the leader
consumes the control file, or the requeued start would drain again at its first boundary.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from rlslurm import lifecycle
from rlslurm.checkpoint import IntervalPolicy
from rlslurm.diag.drain_gate import DrainGate, agreed_reason
from rlslurm.dist import Topology, compute_device
from rlslurm.lifecycle import ExitCode
from rlslurm.rundir import RunDir


def slurm_time_limit_s(time_limit_min: float, env: Mapping[str, str] | None = None) -> float | None:
    """The allocation's time limit in seconds (cluster.time_limit_min) when this process runs under SLURM; None
    elsewhere, where nothing ends the run at a time limit."""
    e = os.environ if env is None else env
    return time_limit_min * 60.0 if e.get("SLURM_JOB_ID") else None


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed at one step boundary."""

    drain: bool
    """Some rank was asked to drain (signal, control file): every rank stops here."""
    time_left_s: float | None
    """The least KillWait left over the ranks after a SIGTERM (None: no SIGTERM)."""
    checkpoint_due: bool
    """Rank 0's interval policy says a checkpoint is due at this step."""
    stop: bool
    """Some rank's loop asked to stop here (`agree(stop=True)`: SFT's dev target reached)."""


class StepBoundary:
    """One loop's step boundary on one rank: the agreement across ranks, the drain, the control file, the time
    limit. `interval` is the checkpoint policy the loop reports its steps and saves to."""

    def __init__(self, run: RunDir, topo: Topology, gate: DrainGate, job, *, start_step: int,
                 time_limit_s: float | None = None, requeue: Callable[[str], object] = lifecycle.requeue_job):
        """`job`: the JobConfig (checkpoint.*, cluster.time_limit_min); `time_limit_s` overrides the SLURM
        allocation's limit (None: SLURM's when under SLURM, else none)."""
        self.run, self.topo, self.gate, self.requeue = run, topo, gate, requeue
        if time_limit_s is None:
            time_limit_s = slurm_time_limit_s(job.cluster.time_limit_min)
        self.interval = IntervalPolicy(job.checkpoint, time_limit_s=time_limit_s, start_step=start_step)

    def agree(self, step: int, *, stop: bool = False) -> Agreement:
        """Collective: every rank calls it at every boundary and gets the same Agreement."""
        gate = self.gate
        left = gate.kill_wait_left_s() if gate.check() else None
        # The flags travel over the default group: NCCL reduces GPU tensors only, gloo (the toy job's group even on
        # a GPU node) CPU ones.
        device = torch.device("cpu") if dist.get_backend() == "gloo" else compute_device()
        flags = torch.tensor([float(gate.requested), -(left if left is not None else math.inf),
                              float(self.topo.is_main and self.interval.due(step)), float(stop)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return Agreement(drain=bool(flags[0] > 0), time_left_s=None if math.isinf(flags[1]) else -flags[1].item(),
                         checkpoint_due=bool(flags[2] > 0), stop=bool(flags[3] > 0))

    def drain(self, step: int, agreed: Agreement, save: Callable[[], str | None], *,
              before: Callable[[str | None], None] | None = None) -> ExitCode:
        """Collective, once `agree` said drain: DRAINED (checkpointed and requeued), or what finish_drain decides.
        `save` checkpoints step `step` (collective) and returns its name; `before(signal_name)` drains what the
        loop runs beside the trainer first (the RL controller's engines)."""
        reason, signal_name = agreed_reason(self.gate, self.topo.world_size)
        if before is not None:
            before(signal_name)
        code = lifecycle.finish_drain(self.run, step=step, reason=reason or "drain requested by a peer rank",
                                      signal_name=signal_name, save=save, cost_s=self.interval.cost_s,
                                      time_left_s=agreed.time_left_s, is_leader=self.topo.is_main,
                                      requeue=self.requeue)
        if self.topo.is_main and code == ExitCode.DRAINED:
            self.gate.consume_control_file()  # else the requeued job would drain again at its first boundary
        return code
