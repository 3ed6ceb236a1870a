"""The RL entrance: GRPO on the task or a user's data (`data:`), with rollout engines, a reward, and verified
weight sync.

    rlslurm submit examples/tiny-grpo.yaml            # starts from train.init_from (the SFT export) as it is
    rlslurm submit examples/smollm2-grpo.yaml         # a real pretrained model, chat template (docs/real-model.md)
    rlslurm submit examples/grpo-verl.yaml            # a verl parquet and its compute_score (docs/data.md)

Every trainer rank runs `run(job, run_dir)`; rank 0 is also the controller. One step reads like the
diagram at the top of README.md, each phase inside the phase guard:

    prompts -> rollout (engines) -> reward -> advantages -> train (DDP) -> sync (DRAIN/UPDATE/VERIFY/RESUME)
    -> metrics -> checkpoint

Where each part lives (rlslurm/rl/):

    loop.py           the step loop on every rank: boundary agreement, phases, metrics, drain, the final export
    policy.py         the policy interface (RLPolicy) and the torch policy; rlslurm/megatron/policy.py the other
    controller.py     rank 0: prompts, rollout, reward, advantages, weight sync, evaluation
    engines.py        the rollout engines: spawned beside rank 0, or announced by the rollout het component
    checkpointing.py  the RL checkpoint (trainer + RL state) and where a start resumes
    roles.py          the rollout and reward het components' entrances (run_engine, run_reward)
    experience.py, pipeline.py   samples, advantages, and the rollouts that run ahead (rl.max_staleness)

Engines are separate server processes (rlslurm/rollout/server.py): on SLURM with separate placement
the rollout het component runs them (`run_engine`) and they announce themselves in <run>/endpoints/;
colocated (a plain SLURM job) or off SLURM the controller spawns them beside itself. Samples carry the
policy version that produced them.

Drain (USR1, `rlslurm drain`, SIGTERM): the trainer ranks agree at a step boundary, the controller
drains the engines, rank 0 checkpoints (model, optimizer, every rank's RNG, step = data position,
policy version, eval history) and requeues the whole het job; the next start resumes at that step and
version and syncs the new engines to it. Engine sampling is seeded by (train.seed, step, engine), so
a resumed run draws the same samples: tests/cluster/test_rl_slurm.py holds it to the uninterrupted
run's reward/loss trajectory.

The reward (`reward.service`): `inline` (the default, and the example's) scores in the controller (the task's
rule; a data row by the service's own rule or function scorer, rlslurm/rl/scoring.py); `local` runs the
supervised reward service (rlslurm/reward/) beside the controller; `component`
runs it in a het component of its own on `reward.partition` (`run_reward`, announced in
<run>/endpoints/reward.json). Each engine's responses go to the service as they arrive, `reward.batch_size`
per request; a response it cannot score is degraded by `reward.degrade`, and each step's metrics count
reward_degraded, reward_degraded_ratio, reward_dropped and reward_restarts (see docs/reward-service.md).

Whether it learns depends less on this file than on where it starts: from a cosine-annealed SFT minimum
the first steps of a fresh Adam lose accuracy whatever the loss (plain SFT does the same); from the
constant-lr SFT of examples/tiny-sft.yaml, GRPO at lr 3e-4 takes held-out accuracy 0.374 -> 0.594 in 60
steps (tests/integration/test_rl_learns.py).
"""

from rlslurm.rl.loop import run
from rlslurm.rl.roles import run_engine, run_reward

__all__ = ["run", "run_engine", "run_reward"]
