"""Values one part of a job config sets that the chosen layout would ignore: each is an error naming both keys.

    for key, message in ignored_values(job):   # JobConfig.__post_init__ raises the first
        ...

Found by reading how a job uses its config (rlslurm/layout.py and launch.py's submission, rlslurm/rl/'s
engines, transports and reward session, jobs/sft.py, the plan): `placement.rollout_nodes` with
`placement.mode: colocate` never reaches the layout; `rollout.engines = 3` on 2 rollout nodes starts 4
engines and uses 3; `sync.weights_dir` with broadcast sync is never written; `reward.scorer: judge` with
`reward.service: inline` scores with the task's rule. A value still at its default is never reported (the
resolved config in a run directory spells out every default).

Rules that need the plan's choice (the split under `placement.mode: auto` without rollout_nodes) are
checked only where the config alone states the layout (rlslurm/plan/placement.py `stated_placement`, the
planner's own reading of it; `auto` sync is resolved by SyncConfig.resolved_method alone).

`job_rules` is every rule between sections, in the order `JobConfig.__post_init__` checks them (the first one
broken is the error): what the sections must agree on (`between_sections`: placement and hardware, the reward
component's partition, SFT's dev target, ...), the values the layout would ignore (`ignored_values`), what the
Megatron trainer cannot run (`megatron_rules`) and the parallel layout's divisibility (`parallel_rules`, all of
its broken rules in one message). One module, as torchtitan keeps its cross-section checks in one validation
module: config.py imports nothing of the trainers to check a job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rlslurm.plan.parallel import static_rules, world_rules
from rlslurm.plan.placement import stated_placement
from rlslurm.rl.config import job_rules as rl_algorithm_rules
from rlslurm.safeyaml import excerpt

if TYPE_CHECKING:  # config.py imports this module
    from rlslurm.config import JobConfig

Rule = tuple[str, str]
"""(the key to blame, a message that starts with it and names the other key)."""


def _changed(obj: Any, *names: str) -> Iterator[tuple[str, Any]]:
    """(name, value) of each field among `names` (all when none) whose value is not its default; a nested
    config object is walked, its fields named `outer.inner`."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for name in names or tuple(fields):
        f, value = fields[name], getattr(obj, name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if value == default:
            continue
        if dataclasses.is_dataclass(value):
            yield from ((f"{name}.{inner}", v) for inner, v in _changed(value))
        else:
            yield name, value


def _ignored(key: str, value: Any, by: str, why: str, fix: str) -> Rule:
    return key, f"{key} = {excerpt(value)} is ignored with {by} ({why}): {fix}"


def job_rules(job: "JobConfig") -> Iterator[Rule]:
    """Every rule between the sections of `job` that it breaks, in the order they are checked."""
    yield from between_sections(job)
    yield from ignored_values(job)
    if job.train.backend == "megatron":
        yield from megatron_rules(job)
    yield from parallel_rules(job)


def between_sections(job: "JobConfig") -> Iterator[Rule]:
    """What two sections must agree on: a layout that leaves training no node, an engine wider than a node, the
    reward component without a partition, SFT's dev target without a dev split, data for a loop that reads none."""
    hw, pl = job.hardware, job.placement
    if pl.rollout_nodes is not None and not pl.rollout_nodes < hw.nodes:
        yield ("placement.rollout_nodes", f"must leave training at least one node: placement.rollout_nodes = "
                                          f"{pl.rollout_nodes}, hardware.nodes = {hw.nodes}")
    if not job.rollout.tp <= hw.gpus_per_node:
        yield ("rollout.tp", f"must be <= hardware.gpus_per_node = {hw.gpus_per_node} (one engine stays inside "
                             "a node)")
    if job.reward.service == "component" and not job.reward.partition:
        yield ("reward.partition", "is required when reward.service = 'component' (the SLURM partition of the "
                                   "reward component)")
    if job.job.kind == "sft" and job.train.stop_at_accuracy is not None:
        if job.data.train is not None:
            yield ("train.stop_at_accuracy", "is measured on the arithmetic task's dev split (task.dev_size); with "
                                             "data.train it is not built yet: remove it and set train.steps")
        if not job.task.dev_size > 0:
            yield ("train.stop_at_accuracy", "needs a dev split to measure it on: set task.dev_size (e.g. 500), "
                                             "disjoint from train and held-out")
    if job.data.train is not None and job.job.kind not in ("sft", "rl"):
        yield ("data.train", f"is read by the sft and rl entrances; job.kind = {job.job.kind!r} has no data")


def megatron_rules(job: "JobConfig") -> Iterator[Rule]:
    """Each setting the Megatron trainer (rlslurm/megatron/: SFT or RL) cannot run, with train.backend =
    megatron; MegatronPolicy checks a hand-built job again."""
    if job.job.kind not in ("rl", "sft"):
        yield ("train.backend", f"is implemented for job.kind = 'rl' and 'sft', not job.kind = {job.job.kind!r}: "
                                "set train.backend = torch")
    if job.job.kind == "rl" and job.rl.kl_coef > 0:
        yield ("rl.kl_coef", "> 0 needs a frozen reference model, which train.backend = 'megatron' does not build "
                             "yet: set rl.kl_coef = 0 or train.backend = torch")
    # The layouts its trainer does not split over yet (PP, CP, EP, MoE) are planned and refused by the pre-flight
    # (rlslurm/plan/parallel.py trainer_rules): the arithmetic is for the cluster a user will run.
    if job.train.lora.enabled:
        yield ("train.lora.rank", "is refused with train.backend = 'megatron': megatron-core 0.16 has no LoRA layer "
                                  "of its own (NeMo's PEFT lives outside it); set train.backend: torch (PEFT, "
                                  "rlslurm/lora.py) or train.lora.rank: 0")
    if job.memory.weight_bytes not in (None, 2.0, 4.0):
        yield ("memory.weight_bytes", "must be 2 (bf16 weights, fp32 master copy) or 4 (fp32) with "
                                      "train.backend = 'megatron'")


def parallel_rules(job: "JobConfig") -> Iterator[Rule]:
    """The parallel layout's divisibility (rlslurm/plan/parallel.py) against the model and, where the config
    states the split, the training GPUs: one rule naming every broken one, since a layout is fixed once."""
    m = job.model
    rules = [(r.keys, r.message) for r in static_rules(job.parallel, m.layers, m.heads, m.n_kv_heads, m.experts,
                                                         job.hardware.gpus_per_node, job.rollout.tp)]
    world = _train_gpus(job)
    if world is not None:
        rules += [(r.keys, r.message + _split_note(job)) for r in world_rules(job.parallel, world)]
    if len(rules) == 1:
        yield rules[0][0][0], rules[0][1]
    elif rules:
        keys = list(dict.fromkeys(keys[0] for keys, _ in rules))
        yield keys[0], (f"{', '.join(keys)}: {len(rules)} parallel rules are broken: "
                        + "; ".join(f"({n}) {message}" for n, (_, message) in enumerate(rules, 1)))


def _train_gpus(job: "JobConfig") -> int | None:
    """Training GPUs of the configured split; None while the plan has yet to choose it."""
    hw, pl = job.hardware, job.placement
    if pl.mode == "colocate":
        return hw.total_gpus
    if pl.rollout_nodes is not None:
        return (hw.nodes - pl.rollout_nodes) * hw.gpus_per_node
    return None


def _split_note(job: "JobConfig") -> str:
    pl, hw = job.placement, job.hardware
    return (f" (placement.mode = {pl.mode!r}, placement.rollout_nodes = {pl.rollout_nodes}, "
            f"hardware.nodes = {hw.nodes} x hardware.gpus_per_node = {hw.gpus_per_node})")


def ignored_values(job: "JobConfig") -> Iterator[Rule]:
    """Every value of `job` that its layout, job kind, engine, transport or reward service would ignore."""
    yield from _placement(job)
    yield from _engines(job)
    yield from _cluster(job)
    yield from _model_and_memory(job)
    yield from _logging(job)
    if job.job.kind == "rl":
        yield from _rl_sync(job)
        yield from _rl_reward(job)
        yield from _rl_train(job)
        yield from rl_algorithm_rules(job)  # the GRPO family's switches (rlslurm/rl/config.py)
    if job.job.kind == "sft":
        yield from _sft(job)


def _logging(job: "JobConfig") -> Iterator[Rule]:
    """rlslurm/metrics_sinks.py: the SFT and RL trainers send metrics to the sinks; the toy loop does not."""
    if job.job.kind == "toy":
        for name, value in _changed(job.logging):
            yield _ignored(f"logging.{name}", value, "job.kind = 'toy'", "the toy loop writes metrics.jsonl only",
                           "remove it")
    if not job.logging.wandb:
        for name, value in _changed(job.logging, "wandb_project", "wandb_name"):
            yield _ignored(f"logging.{name}", value, "logging.wandb = false", "nothing is sent to W&B",
                           "set logging.wandb: true, or remove it")


def _placement(job: "JobConfig") -> Iterator[Rule]:
    pl, layout = job.placement, stated_placement(job.placement)
    mode = f"placement.mode = {pl.mode!r}"
    if pl.rollout_nodes is not None and pl.mode == "colocate":
        yield _ignored("placement.rollout_nodes", pl.rollout_nodes, mode,
                       "every GPU trains and rollout time-shares them", "remove it, or set placement.mode: separate")
    if pl.rollout_nodes == 0 and pl.mode == "separate":
        yield ("placement.rollout_nodes", f"placement.rollout_nodes = 0 contradicts {mode}: separate rollout needs "
                                          "nodes of its own; give it at least 1, or set placement.mode: colocate")
    if pl.rollout_nodes == 0 and pl.mode == "auto":
        yield _ignored("placement.rollout_nodes", 0, mode, "the plan then picks its own split",
                       "set placement.mode: colocate for no rollout nodes, or null to let the plan choose")
    if layout == "separate":
        by = mode if pl.mode == "separate" else f"placement.rollout_nodes = {pl.rollout_nodes}"
        for name, value in _changed(pl, "offload", "colocate_min_seqs"):
            yield _ignored(f"placement.{name}", value, by, "it applies to colocated rollout only", "remove it")


def _engines(job: "JobConfig") -> Iterator[Rule]:
    """rlslurm/layout.py's JobLayout runs ceil(engines / rollout nodes) engine tasks on every rollout node."""
    r, nodes = job.rollout, job.placement.rollout_nodes
    if job.job.kind == "rl" and r.engine == "hf" and r.tp > 1:
        yield _ignored("rollout.tp", r.tp, "rollout.engine = 'hf'", "the transformers engine runs on one device",
                       "set rollout.tp: 1")
    if job.job.kind == "sft" or stated_placement(job.placement) != "separate" or not nodes:
        return
    per_node = -(-r.engines // nodes)
    if r.engines % nodes:
        yield ("rollout.engines",
               f"rollout.engines = {r.engines} is not a multiple of placement.rollout_nodes = {nodes}: every rollout "
               f"node runs {per_node} engine(s), so {per_node * nodes} start and {per_node * nodes - r.engines} of "
               f"them are never used; set rollout.engines to a multiple of {nodes}")
    if per_node * r.tp > job.hardware.gpus_per_node:
        yield ("rollout.engines",
               f"rollout.engines = {r.engines} on placement.rollout_nodes = {nodes} is {per_node} engine(s) of "
               f"rollout.tp = {r.tp} per node, {per_node * r.tp} GPUs, but hardware.gpus_per_node = "
               f"{job.hardware.gpus_per_node}: lower rollout.engines or give rollout more nodes")


def _cluster(job: "JobConfig") -> Iterator[Rule]:
    cl = job.cluster
    if cl.tasks_per_node is not None and cl.tasks_per_node != job.hardware.gpus_per_node:
        yield ("cluster.tasks_per_node",
               f"cluster.tasks_per_node = {cl.tasks_per_node} differs from hardware.gpus_per_node = "
               f"{job.hardware.gpus_per_node}: the plan checks memory and divisibility for one rank per GPU, the "
               "job would start another number; set one of them (or leave tasks_per_node null)")
    gres = [g.split(":")[0] for g in (cl.gres_per_node or "").split(",")]
    if cl.backend != "local" and "gpu" in gres and job.hardware.profile != "cpu":
        yield ("cluster.gres_per_node",
               f"cluster.gres_per_node = {excerpt(cl.gres_per_node)} asks for GPUs, which a job of hardware.profile = "
               f"{job.hardware.profile!r} asks itself from the plan (--gpus-per-node: one per trainer rank, "
               "rollout.tp per engine; `rlslurm plan` shows them): remove gpu from cluster.gres_per_node")
    if cl.backend == "local":
        by = "cluster.backend = 'local'"
        for name, value in _changed(cl, "train_partition", "rollout_partition", "cpus_per_task", "mem_gb",
                                    "gres_per_node", "extra_sbatch"):
            yield _ignored(f"cluster.{name}", value, by, "this machine runs the job, no SLURM",
                           "remove it, or set cluster.backend: slurm (or auto)")
        if job.reward.partition is not None:
            yield _ignored("reward.partition", job.reward.partition, by, "this machine runs the job, no SLURM",
                           "remove it, or set cluster.backend: slurm (or auto)")


def _model_and_memory(job: "JobConfig") -> Iterator[Rule]:
    m = job.model
    if not m.experts:
        for name, value in _changed(m, "topk", "expert_ffn_hidden"):
            yield _ignored(f"model.{name}", value, "model.experts = 0", "a dense model routes to no expert",
                           "remove it, or set model.experts")
    if job.memory.activation_gb is not None:
        for name, value in _changed(job.memory, "temporaries_gb"):
            yield _ignored(f"memory.{name}", value, f"memory.activation_gb = {job.memory.activation_gb:g}",
                           "the measured figure includes the temporaries", "remove one of them")


def _rl_sync(job: "JobConfig") -> Iterator[Rule]:
    s, layout = job.sync, stated_placement(job.placement)
    method = s.resolved_method(layout)
    by = f"sync.method = {s.method!r}"
    if s.method != "disk":
        for name, value in _changed(s, "weights_dir", "keep_versions"):
            yield _ignored(f"sync.{name}", value, by, "only the disk transport writes weight files",
                           "remove it, or set sync.method: disk")
    if s.method == "disk":
        for name, value in _changed(s, "bucket_mb"):
            yield _ignored(f"sync.{name}", value, by, "the disk transport writes whole safetensors files",
                           "remove it")
    if s.store_port and method in ("disk", "ipc"):
        how = by if s.method == method else f"{by} ({method} when {layout}d)"
        yield _ignored("sync.store_port", s.store_port, how, "only the broadcast group has a store",
                       "remove it, or set sync.method: broadcast")
    if s.method == "ipc" and layout == "separate":
        yield ("sync.method", f"sync.method = 'ipc' needs colocated engines, but placement.mode = "
                              f"{job.placement.mode!r} with placement.rollout_nodes = {job.placement.rollout_nodes} "
                              "puts them on other nodes (no shared GPU memory): use broadcast or disk, or "
                              "placement.mode: colocate")


_SERVICE_ONLY = ("batch_size", "timeout_s", "retries", "retry_backoff_s", "degrade", "neutral_score",
                 "degraded_alert_ratio", "port", "health_interval_s", "health_timeout_s", "unhealthy_after",
                 "start_timeout_s", "max_restarts")
"""reward.* that only the reward service and its client read: with reward.service inline the controller
scores each response in-process by the task's rule, with no request to time out, retry or degrade."""
_INLINE_ROWS = ("timeout_s", "degrade", "neutral_score")
"""reward.* the inline scorer of a user's rows reads too (rlslurm/rl/scoring.py: each item bounded, then degraded)."""
_INLINE_SCORERS = ("rule", "function")
"""Scorers reward.service inline runs for a user's rows (rlslurm/rl/scoring.py): the service would add only an HTTP
round trip per batch. code, model and judge keep the supervised service (a sandbox's or an endpoint's failures
are the service's to absorb)."""


def _rl_reward(job: "JobConfig") -> Iterator[Rule]:
    w = job.reward
    service, scorer = f"reward.service = {w.service!r}", f"reward.scorer = {w.scorer!r}"
    rows = job.data.train is not None
    if w.service == "inline":
        if not rows and w.scorer != "rule":
            yield _ignored("reward.scorer", w.scorer, service, "the controller scores the task with its own rule",
                           "set reward.service: local (or component) for another scorer")
        if rows and w.scorer not in _INLINE_SCORERS:
            yield ("reward.scorer", f"reward.scorer = {w.scorer!r} needs the supervised reward service, but "
                                    f"{service} scores in the controller (only {' and '.join(_INLINE_SCORERS)} do): "
                                    "set reward.service: local (or component)")
        for name, value in _changed(w, *_SERVICE_ONLY):
            if not (rows and name in _INLINE_ROWS):
                yield _ignored(f"reward.{name}", value, service, "no service: the controller scores in-process",
                               "remove it, or set reward.service: local")
    if w.partition is not None and w.service != "component":
        yield _ignored("reward.partition", w.partition, service, "only a reward component has a partition",
                       "remove it, or set reward.service: component")
    if w.service == "component" and stated_placement(job.placement) == "colocate":
        yield ("reward.service", "reward.service = 'component' needs a rollout component (het component 2 follows "
                                 "component 1), but placement.mode = 'colocate' has none: use reward.service: local")
    if w.scorer not in ("model", "judge") and w.endpoint is not None:
        yield _ignored("reward.endpoint", "<set>", scorer, "only the model and judge scorers call an endpoint",
                       "remove it, or set reward.scorer: model or judge")
    if w.scorer != "judge":
        for name, value in _changed(w, "judge_model", "judge_rubric", "judge_max_score"):
            yield _ignored(f"reward.{name}", value, scorer, "only the judge scorer reads it", "remove it")
    if w.scorer != "function" and w.function is not None:
        yield _ignored("reward.function", w.function, scorer, "only the function scorer calls it",
                       "remove it, or set reward.scorer: function")
    if w.scorer != "rule" and w.format_regex is not None:
        yield _ignored("reward.format_regex", w.format_regex, scorer, "only the rule scorer reads it", "remove it")
    if w.scorer != "code":
        for name, value in _changed(w, "sandbox"):
            yield _ignored(f"reward.{name}", value, scorer, "only the code scorer runs programs", "remove it")
    if w.degrade != "neutral":
        for name, value in _changed(w, "neutral_score"):
            yield _ignored(f"reward.{name}", value, f"reward.degrade = {w.degrade!r}",
                           "only degrade: neutral gives degraded responses a score", "remove it")
    if w.retries == 0:
        for name, value in _changed(w, "retry_backoff_s"):
            yield _ignored(f"reward.{name}", value, "reward.retries = 0", "there is no retry to wait for",
                           "remove it")


def _rl_train(job: "JobConfig") -> Iterator[Rule]:
    """jobs/rl.py reads train.steps, lr, grad_clip, weight_decay, seed, init_from and the timeouts; the batch
    and the schedule belong to SFT (jobs/sft.py) and the toy loop."""
    for name, value in _changed(job.train, "batch_size", "lr_schedule", "warmup_steps", "stop_at_accuracy",
                                "eval_every_steps"):
        yield _ignored(f"train.{name}", value, "job.kind = 'rl'",
                       "a GRPO step trains on rl.prompts_per_step x rl.samples_per_prompt samples at train.lr",
                       "remove it")


def _sft(job: "JobConfig") -> Iterator[Rule]:
    """An SFT job has no rollout (jobs/sft.py; rlslurm/launch.py gives it no rollout component): every node
    trains. Its rl, reward and sync sections are ignored too, but not reported: a run directory's resolved
    config records the defaults of its day, and an old SFT run must still load after a default changed."""
    pl = job.placement
    if pl.mode == "separate" or pl.rollout_nodes is not None:
        key, value = ("placement.rollout_nodes", pl.rollout_nodes) if pl.rollout_nodes is not None else \
            ("placement.mode", pl.mode)
        yield _ignored(key, value, "job.kind = 'sft'", "an SFT job has no rollout: every node trains",
                       "remove it, or set placement.mode: colocate")
    if job.train.stop_at_accuracy is None:
        # task.dev_size is not reported: it defines the task's splits, which SFT and RL configs share as they are.
        for name, value in _changed(job.train, "eval_every_steps"):
            yield _ignored(f"train.{name}", value, "train.stop_at_accuracy = null",
                           "the dev split is evaluated only to decide when SFT stops",
                           "set train.stop_at_accuracy, or remove it")
