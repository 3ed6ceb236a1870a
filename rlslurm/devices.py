"""Which GPUs each task of the job uses, as its launcher hands them down, and what a task records of them.

    lay = JobLayout.read(run)
    local_gpu_ids(lay)                      # a local run: this machine's GPUs the job takes (submitit's visible_gpus)
    component_step(lay, group)              # (srun args, env) of the rollout / reward component's step
    spawned_engine_env(lay, i)              # CUDA_VISIBLE_DEVICES of engine i spawned beside trainer rank 0
    seen(lay, "train", local_rank)          # what placement.jsonl records: the variables and the GPUs taken

Who gives what (the numbers are the plan's, rlslurm/plan/gpus.py, carried by rlslurm/layout.py):
- trainer ranks: component 0 asks `--gpus-per-node` = its ranks per node; SLURM shows every rank its node's
  GPUs of the job and each rank takes its local rank's (rlslurm/dist.py `init_process_group`), the way
  torchrun does, so NCCL sees its peers on the node. A local run gets `gpus_per_node` from submitit's
  local executor (which otherwise sets an empty CUDA_VISIBLE_DEVICES for every task).
- engines of the rollout component: it asks engines-per-node x rollout.tp GPUs per node, and its step runs
  with `srun --gpus-per-task=<tp>`, which binds each engine task to tp GPUs of its own (SLURM's gpu-bind).
- engines spawned beside trainer rank 0: each gets its own CUDA_VISIBLE_DEVICES, the layout's positions
  among the GPUs rank 0 sees.
- the reward component and every component of a job that asks no GPUs: CUDA_VISIBLE_DEVICES empty. SLURM
  clears it for a step without GPUs on a node with GPUs, but on a node without any GRES a step keeps the
  value it inherited from the batch shell (component 0's GPUs; measured on 22.05).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

from rlslurm.errors import PreflightError, RlslurmError
from rlslurm.layout import JobLayout

CVD = "CUDA_VISIBLE_DEVICES"
RECORDED = (CVD, "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
"""What a task records of the GPUs it was given. SLURM_JOB_GPUS of a het component's step is the batch
shell's, i.e. component 0's (inherited; measured on 22.05): SLURM_STEP_GPUS is the step's own."""


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of GPU ids ([] when empty); None when unset (every GPU is visible)."""
    value = (os.environ if env is None else env).get(CVD)
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def machine_gpus(env: Mapping[str, str] | None = None, dev: str = "/dev") -> list[str]:
    """The GPUs a local run may hand out: CUDA_VISIBLE_DEVICES where it is set (a SLURM allocation, the user),
    else every GPU the NVIDIA driver exposes here (/dev/nvidia<N>, as CUDA numbers them: 0, 1, ...)."""
    visible = visible_gpus(env)
    if visible is not None:
        return visible
    count = len([p for p in glob.glob(f"{dev}/nvidia*") if p[len(dev) + 7:].isdigit()])
    return [str(i) for i in range(count)]


def local_gpu_ids(lay: JobLayout, env: Mapping[str, str] | None = None) -> list[int]:
    """The machine's GPUs a local run hands its tasks (submitit's `visible_gpus`, `gpus_per_node` of them);
    PreflightError when the machine has fewer than the layout needs."""
    if not lay.local_gpus:
        return []
    env = os.environ if env is None else env
    have = machine_gpus(env)
    if len(have) < lay.local_gpus:
        raise PreflightError(
            f"this job needs {lay.local_gpus} GPUs of this machine ({lay.train_world} trainer rank(s)"
            + (f" and {len(lay.spawned_engine_gpus)} engine(s) of {lay.gpus_per_engine}" if lay.spawned_engine_gpus
               else "") + f"), but it has {len(have)} ({CVD}={env.get(CVD, '<unset>')!r} or /dev/nvidia*): "
            "run it where the GPUs are, or plan it for them (hardware.profile cpu asks for none)")
    if not all(g.isdigit() for g in have):
        raise PreflightError(f"{CVD}={','.join(have)} names GPUs by UUID or MIG id; the local executor hands "
                             "GPUs to its tasks by index: set it to indices (e.g. 0,1)")
    return [int(g) for g in have[:lay.local_gpus]]


def component_step(lay: JobLayout, group: int) -> tuple[list[str], dict[str, str]]:
    """(srun args, env) of het component `group`'s step: the rollout component's engines each bound to
    gpus_per_engine GPUs of their own; a component without GPUs sees none."""
    if group == 1 and lay.rollout_gpus_per_node:
        return [f"--gpus-per-task={lay.gpus_per_engine}"], {}
    return [], {CVD: ""}


def spawned_engine_env(lay: JobLayout, index: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of engine `index` spawned beside trainer rank 0: its own GPUs, the layout's
    positions among those rank 0 sees; empty when the job asks no GPUs."""
    if not lay.spawned_engine_gpus:
        return {CVD: ""}
    positions = lay.spawned_engine_gpus[index]
    visible = visible_gpus(env)
    if visible is None:
        return {CVD: ",".join(map(str, positions))}
    if max(positions) >= len(visible):
        raise RlslurmError(f"engine {index} takes GPU position(s) {positions} of trainer rank 0's, but rank 0 sees "
                           f"{len(visible)} ({CVD}={','.join(visible)!r}): the job was given fewer GPUs than its "
                           "layout (layout.json) asks")
    return {CVD: ",".join(visible[p] for p in positions)}


def seen(lay: JobLayout, role: str, local_rank: int, env: Mapping[str, str] | None = None) -> dict:
    """What a task records in placement.jsonl: the GPU variables it started with, and the GPUs it takes
    (a trainer rank its local rank's; an engine every GPU it sees; the reward service none)."""
    env = os.environ if env is None else env
    record = {name.lower(): env.get(name) for name in RECORDED}
    visible = visible_gpus(env)
    taken: list[str] = []
    if role == "train" and lay.gpus_per_train_task:
        if visible is None:
            taken = [str(local_rank)]
        elif local_rank < len(visible):
            taken = [visible[local_rank]]
    elif role == "rollout" and lay.gpus_per_engine:
        taken = visible if visible is not None else []
    return {**record, "gpus": taken}
