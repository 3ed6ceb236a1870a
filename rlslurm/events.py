"""The append-only events log of a run, and every kind of event in it, declared once.

    from rlslurm import events
    events.emit(run, events.RESUME, step=12, checkpoint="step-00000012", restart_count=1)
    events.read_events(run, events.SYNC_VERIFY_FAILED)     # [{"t", "kind", "host", ..., "version", ...}]

    python -m rlslurm.events > docs/events.md               # the table of kinds (a test keeps it current)

Each event is one JSON line {"t", "kind", "host", "pid", "role", "rank", ...fields}; `role` and `rank`
come from RLSLURM_ROLE / RLSLURM_RANK when not given. Every kind is declared below with `declare`: its name,
one line of meaning, its fields (required / optional) and the modules that emit it. `emit` refuses a kind
that is not declared here and an event without its required fields (a programming error, caught in CI by
tests/unit/test_event_kinds.py, which also reads the source: every kind a reader names is emitted
somewhere, every kind emitted is declared, and every declaration has an emitter and a reader or says it is
informational). Readers (diag's cause classifier, status, progress, report, the reward session) name kinds
by these constants, never by strings.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Iterable

from rlslurm.node import node_name
from rlslurm.rundir import RunDir, read_jsonl

BASE_FIELDS = ("t", "kind", "host", "pid", "role", "rank")
"""Fields of every event, filled in by `emit` (`host`, `role` and `rank` may be given)."""


@dataclass(frozen=True, kw_only=True)
class EventKind:
    """One kind of event of the run's events.jsonl."""

    name: str
    """The `kind` of its JSON line."""
    meaning: str
    """One line: what happened."""
    emitted_by: tuple[str, ...]
    """Repository paths of the modules that emit it (checked against the source by the event-kind test)."""
    required: tuple[str, ...] = ()
    """Fields every event of this kind carries, beside BASE_FIELDS."""
    optional: tuple[str, ...] = ()
    """Fields it may carry."""
    open_fields: bool = False
    """Further fields may follow (a splat of metrics or of a summary): only the required ones are checked."""
    informational: bool = False
    """No reader of rlslurm looks for this kind: it is there for people (`rlslurm status`, the diag bundle)."""

    def matches(self, event: dict) -> bool:
        return event.get("kind") == self.name


KINDS: dict[str, EventKind] = {}
"""Every declared kind by name."""


def declare(name: str, meaning: str, *, by: str | tuple[str, ...], required: tuple[str, ...] = (),
            optional: tuple[str, ...] = (), open_fields: bool = False, informational: bool = False) -> EventKind:
    """Declare one kind (once: a second declaration of a name is a programming error)."""
    if name in KINDS:
        raise ValueError(f"event kind {name!r} is declared twice")
    kind = EventKind(name=name, meaning=meaning, emitted_by=(by,) if isinstance(by, str) else tuple(by),
                     required=required, optional=optional, open_fields=open_fields, informational=informational)
    KINDS[name] = kind
    return kind


# -- a job's start and end (rlslurm/lifecycle.py, rlslurm/launch.py, the entrances) ---------------------

SUBMITTED = declare("submitted", "rlslurm submit / resume handed the job to SLURM or to the local backend",
                    by="rlslurm/launch.py", required=("job_id", "backend", "layout"), optional=("resume_of",))
CONFIG_CHANGED = declare("config_changed", "rlslurm resume --set changed the stopped run's config",
                         by="rlslurm/launch.py", required=("overrides",), informational=True)
PREFLIGHT_FORCED = declare("preflight_forced", "submitted with --force past the plan's pre-flight problems",
                           by="rlslurm/launch.py", required=("problems",))
COMPONENT_STARTED = declare("component_started", "a het-job component's first task started on its nodes",
                            by="rlslurm/slurm/supervisor.py",
                            required=("component", "component_role", "partition", "nodes", "job_kind"),
                            optional=("srun_args",), informational=True)
START = declare("start", "a start of the job with no checkpoint to resume: training begins at `step`",
                by="rlslurm/lifecycle.py", required=("step", "restart_count"), optional=("trainer_restart",))
RESUME = declare("resume", "a start of the job that resumed from the newest complete checkpoint",
                 by="rlslurm/lifecycle.py", required=("step", "checkpoint", "restart_count"),
                 optional=("trainer_restart",))
RANK_OUTLIVED_JOB = declare("rank_outlived_job", "a trainer rank was still running train.exit_grace_s after rank 0 "
                            "exited 0 (after the final barrier: the job's work was done): it was ended (off SLURM "
                            "its stacks dumped first; on SLURM by srun's own --wait) and the job counts as finished",
                            by=("rlslurm/local_supervisor.py", "rlslurm/slurm/supervisor.py"),
                            required=("stuck_rank", "grace_s", "ended"),
                            optional=("pid", "node", "stack_file", "stack_method"))
TRAINER_RESTARTED = declare("trainer_restarted", "a trainer rank died by a signal (SIGKILL, segfault, OOM kill): "
                            "the trainer ranks start again as a new job step on the same nodes, from the newest "
                            "complete checkpoint, the engines kept (train.max_restarts); off SLURM every rank starts "
                            "again under the local controller",
                            by=("rlslurm/slurm/supervisor.py", "rlslurm/local_supervisor.py"),
                            required=("dead_rank", "node", "cause", "signal", "trainer_restart", "max_restarts",
                                      "restart_count", "srun_exit_code"), optional=("step_s",))
TRAINER_RESTARTS_SPENT = declare("trainer_restarts_spent", "a trainer rank died by a signal and the allocation "
                                 "cannot take another trainer restart (train.max_restarts spent, or a node of "
                                 "component 0 lost): the job is requeued and SLURM asked to keep it off the failed "
                                 "node (`excluded`: the nodes it took)",
                                 by="rlslurm/slurm/supervisor.py",
                                 required=("dead_rank", "node", "cause", "signal", "reason", "restarts",
                                           "max_restarts", "restart_count", "requeue"), optional=("excluded",))
NO_PROGRESS = declare("no_progress", "starts in a row resumed from one step: the job stops requeueing (exit 77)",
                      by="rlslurm/lifecycle.py",
                      required=("step", "checkpoint", "restart_count", "fruitless_starts", "reason"))
MEMORY_CAPPED = declare("memory_capped", "a cpu-profile trainer rank capped what it allocates at hardware.hbm_gb in a "
                        "memory cgroup of its own (or says why it could not: `reason`)", by="rlslurm/memcap.py",
                        required=("rank", "capped", "hbm_gb"),
                        optional=("cap_gb", "rss_at_cap_gb", "limit_bytes", "cgroup", "reason"))
PLAN_OFF = declare("plan_off", "a steady-state figure the plan predicted (plan.json) is more than 10 % off what the "
                   "run measured (rlslurm/plan_vs_run.py): `rlslurm plan CONFIG --from-run RUN` calibrates from it",
                   by="rlslurm/plan_vs_run.py",
                   required=("step", "figure", "planned", "measured", "ratio"), optional=("fix",))
FIRST_STEP = declare("first_step", "the first step of this start is trained (requeue -> training again ends here)",
                     by=("rlslurm/rl/loop.py", "jobs/toytrain.py"), required=("step", "since_process_start_s"),
                     optional=("policy_version", "device"))
EVAL = declare("eval", "held-out evaluation of the starting policy (later ones are in metrics.jsonl): accuracy = "
               "pass rate, mean reward, rows scored", by="rlslurm/rl/loop.py", required=("step", "held_out_accuracy"),
               optional=("eval_reward_mean", "eval_pass_rate", "eval_rows"))
DONE = declare("done", "the RL or toy job trained every step (and exported)",
               by=("rlslurm/rl/loop.py", "jobs/toytrain.py"), required=("step",),
               optional=("policy_version", "held_out_accuracy", "eval_reward_mean", "eval_pass_rate", "weights_sha256"))
SFT_START = declare("sft_start", "an SFT trainer rank started training", by="jobs/sft.py",
                    required=("world_size", "steps", "start_step", "params", "device"), optional=("backend",),
                    informational=True)
SFT_EXPORT = declare("sft_export", "the SFT job wrote its HF export", by="jobs/sft.py", required=("path", "step"),
                     informational=True)
SFT_FINISHED = declare("sft_finished", "an SFT trainer rank trained to its end: train.steps, or the dev-split target "
                       "train.stop_at_accuracy (`stopped_by`; rank 0: exported and evaluated)",
                       by="jobs/sft.py", required=("step", "weights_sha256", "stopped_by"), open_fields=True)
DATA_ROWS_SKIPPED = declare("data_rows_skipped", "an SFT or RL step left out training rows: longer than "
                            "model.max_positions (data.too_long = drop) or cut to it (truncate), or a row that broke "
                            "the data layout's rules (past data.max_bad_share of the rows drawn the job stops)",
                            by=("jobs/sft.py", "rlslurm/rl/controller.py"),
                            required=("step", "too_long", "truncated", "bad_rows"),
                            optional=("first_reason",), informational=True)
FINISHED = (DONE, SFT_FINISHED)
"""The kinds a job emits when it trained to the end."""

# -- drain, requeue, checkpoints ----------------------------------------------------------------------

DRAIN_REQUESTED = declare("drain_requested", "a drain was asked for (signal, control file, rlslurm drain)",
                          by=("diag/drain_gate.py", "rlslurm/cli/drain.py"), required=("reason",),
                          optional=("signal", "kill_wait_left_s", "job_id", "file"))
DRAIN_REQUEST_STALE = declare("drain_request_stale", "a drain control file older than this start was ignored",
                              by="diag/drain_gate.py", required=("file", "reason"), informational=True)
ENGINES_DRAINED = declare("engines_drained", "the controller drained the rollout engines for a job drain",
                          by=("rlslurm/rl/engines.py", "rlslurm/rl/loop.py"), required=("engines",),
                          optional=("reason",), informational=True)
DRAIN_CHECKPOINT_SKIPPED = declare("drain_checkpoint_skipped", "too little KillWait left for the drain checkpoint",
                                   by="rlslurm/lifecycle.py", required=("step", "reason"), informational=True)
DRAINED = declare("drained", "every rank drained at `step`: checkpointed (if it fit) and left",
                  by="rlslurm/lifecycle.py", required=("step", "reason", "signal", "job_id", "checkpoint", "requeued"))
REQUEUE = declare("requeue", "the leader requeued the whole job through SLURM", by="rlslurm/lifecycle.py",
                  required=("step", "job_id", "reason"))
REQUEUE_FAILED = declare("requeue_failed", "scontrol requeue failed: the job does not come back by itself",
                         by="rlslurm/lifecycle.py", required=("step", "job_id", "error"))
CHECKPOINT_SAVED = declare("checkpoint_saved", "a checkpoint is complete (manifest written, renamed into place)",
                           by="rlslurm/checkpoint.py", required=("step", "checkpoint", "seconds", "bytes"))
CHECKPOINT_FAILED = declare("checkpoint_failed", "writing a checkpoint failed: its temp dir is removed, the newest "
                            "complete one stays what resume takes (`disk_full`: no space left)",
                            by="rlslurm/checkpoint_failure.py",
                            required=("step", "checkpoint", "error", "disk_full", "free_bytes", "filesystem"),
                            optional=("errno", "newest_complete", "attempt", "attempts"))
CHECKPOINT_SAVE_SKIPPED = declare("checkpoint_save_skipped", "every try of a checkpoint save failed "
                                  "(checkpoint.save_attempts, with backoff): training goes on and the newest "
                                  "complete checkpoint stays what resume takes; past checkpoint.max_failed_saves such "
                                  "saves in a row the job stops (`stopping`)", by="rlslurm/rl/checkpointing.py",
                                  required=("step", "attempts", "failed_saves", "max_failed_saves", "error",
                                            "stopping"), optional=("newest_complete",))
CHECKPOINT_SKIPPED = declare("checkpoint_skipped", "resume skipped a broken or half-written checkpoint",
                             by="rlslurm/checkpoint.py", required=("step", "checkpoint", "reason"),
                             optional=("moved_to",))

# -- the operations kit ---------------------------------------------------------------------------------

PHASE_FAILED = declare("phase_failed", "a Python exception left a phase of a process (its innermost phase)",
                       by="diag/guard.py", required=("phase", "step", "error", "traceback"))
HANG_DETECTED = declare("hang_detected", "the watchdog found ranks without progress past their phase timeout",
                        by="diag/watchdog.py",
                        required=("message", "collective", "waiting", "stuck", "policy", "stacks_dir", "ranks"),
                        optional=("attribution", "records"))
HANG_ACTION = declare("hang_action", "what the watchdog did about a hang (dump, requeue, fail)",
                      by="diag/watchdog.py", required=("action", "policy"), open_fields=True)
HEARTBEAT_UNWRITABLE = declare("heartbeat_unwritable", "a process could not write its heartbeat file (OSError: "
                                "its directory unwritable, the disk full); it keeps working and retrying, and the "
                                "node agent stops judging it by heartbeat age until a write succeeds",
                                by="diag/heartbeat.py", required=("path", "error", "errno"))
HEARTBEAT_RESTORED = declare("heartbeat_restored", "a heartbeat that could not be written is written again",
                             by="diag/heartbeat.py", required=("path", "unwritable_s"))
JOB_SUSPENDED = declare("job_suspended", "the node agent found the job suspended (`scontrol suspend`): every rank "
                        "of its node stopped and SLURM calling it SUSPENDED, or itself stopped with them for "
                        "`unobserved_s`; no hang is called for that time, heartbeat ages count from its resume",
                        by="diag/suspend.py", required=("node", "ranks", "slurm_state"), optional=("unobserved_s",),
                        informational=True)
NODE_AGENT_DIED = declare("node_agent_died", "the node agent (diag/watchdog.py) of a node exited while the ranks "
                          "it watches ran (a crash, a kill); restarted within its budget, else that node's hangs "
                          "go unwatched", by="diag/agent.py",
                          required=("node", "agent_pid", "returncode", "cause", "log", "restarted"),
                          optional=("signal", "log_tail"))
RANK_DIED = declare("rank_died", "the node agent found a trainer rank's process gone while its heartbeat still said "
                    "running (no exception, no exit of its own: the OOM killer, a segfault, a SIGKILL), with the "
                    "kernel's OOM-kill counts of its memory cgroup and of its node since the agent first saw it (a "
                    "cpu-profile rank that died before the agent's first look: from its `memory_capped` cgroup)",
                    by="diag/deaths.py", required=("rank_pid", "phase", "step", "oom_killed"),
                    optional=("cgroup", "cgroup_oom_kills", "node_oom_kills", "memory_limit_bytes",
                              "memory_peak_bytes"))
ENV_DIFF = declare("env_diff", "the controller's env-fingerprint check before the first sync found differences",
                   by="rlslurm/rl/controller.py", required=("report", "ok"))
NODE_LOST = declare("node_lost", "a restart found a node of the previous attempt gone in SLURM (DOWN, not "
                    "responding, drained): the node the job lost, and SLURM's reason",
                    by=("rlslurm/lifecycle.py", "rlslurm/slurm/rejoin.py"),
                    required=("node", "state", "reason", "restart_count"))
FAULT_INJECTED = declare("fault_injected", "a test hook of the toy job injected a fault", by="jobs/toytrain.py",
                         required=("fault", "step", "mode"), optional=("op", "seq"), informational=True)
JOB_SIGTERM = declare("job_sigterm", "SLURM sent SIGTERM to the batch step (a preemption, a requeue, the time "
                      "limit, `scancel --signal=TERM --full`): the trainer supervisor passed it on to the tasks of "
                      "every component, so every rank and role drains", by="rlslurm/slurm/supervisor.py",
                      required=("components", "relayed"), optional=("restart_count",))
BATCH_REQUEUED = declare("batch_requeued", "the batch script (the trainer supervisor) was killed by a signal before "
                         "the job finished, and SLURM ended every component FAILED: rlslurm's strigger requeued it",
                         by="rlslurm/slurm/rejoin.py", required=("job_id", "fired_by", "states", "reason", "result"),
                         informational=True)
COMPONENTS_REQUEUED = declare("components_requeued", "SLURM requeued some of the het job's components and ended the "
                              "others (a lost node): rlslurm's strigger requeued the whole job, off the lost nodes",
                              by="rlslurm/slurm/rejoin.py", required=("job_id", "fired_by", "states", "excluded",
                                                                      "result"), informational=True)

# -- RL: engines, weight sync, steps -------------------------------------------------------------------

ENGINE_FAILED = declare("engine_failed", "a rollout engine failed the job: a request it failed (connection lost, "
                        "HTTP error, no answer in time) or its process died", by="rlslurm/rl/engines.py",
                        required=("url", "cause"), optional=("call", "node", "pid", "exit_code", "status", "log"))
ENGINE_DIED = declare("engine_died", "a rollout engine's server process exited while the job ran; its supervisor "
                      "replaces it (rollout.max_restarts)", by="rlslurm/rollout/supervisor.py",
                      required=("engine", "node", "pid", "exit_code", "url"), optional=("signal", "log"))
ENGINE_UNHEALTHY = declare("engine_unhealthy", "a rollout engine gave no healthy /health answer for "
                           "rollout.hang_timeout_s (a stopped or wedged process): its supervisor killed it to "
                           "replace it", by="rlslurm/rollout/supervisor.py",
                           required=("engine", "node", "pid", "cause", "unhealthy_s", "url"),
                           optional=("process_state", "log"))
ENGINE_RESTARTED = declare("engine_restarted", "a replaced rollout engine serves again (same URL, a new "
                           "generation); it takes traffic once the controller synced and verified it",
                           by="rlslurm/rollout/supervisor.py",
                           required=("engine", "node", "pid", "generation", "url", "reason", "start_s"))
ENGINE_START_FAILED = declare("engine_start_failed", "a restart of a rollout engine did not become healthy; the "
                              "supervisor tries again within its budget", by="rlslurm/rollout/supervisor.py",
                              required=("engine", "attempt", "error"), informational=True)
ENGINE_DOWN = declare("engine_down", "a rollout engine failed past rollout.max_restarts: its supervisor gave up; "
                      "it leaves the rotation for good and the others serve on (every engine down: the job fails "
                      "as an engine failure)", by="rlslurm/rollout/supervisor.py",
                      required=("engine", "node", "restarts", "max_restarts", "reason", "log"))
ENGINE_OUT = declare("engine_out", "the controller took a failed rollout engine out of rotation mid-step; its "
                     "prompts went to the engines left", by="rlslurm/rl/engines.py",
                     required=("engine", "url", "cause", "resent"), optional=("call", "node", "pid", "status"))
ENGINE_READMITTED = declare("engine_readmitted", "a replaced rollout engine passed a weight sync's VERIFY at the "
                            "current version and takes traffic again", by="rlslurm/rl/engines.py",
                            required=("engine", "url", "version", "generation"), optional=("step",))
SYNC_VERIFIED = declare("sync_verified", "a weight sync passed VERIFY and the engines serve `version`",
                        by="rlslurm/sync/protocol.py", required=("version", "transport"), optional=("step",),
                        open_fields=True)
SYNC_VERIFY_MISMATCH = declare("sync_verify_mismatch", "one VERIFY of a weight sync found differing tensors "
                               "(UPDATE is retried)", by="rlslurm/sync/protocol.py",
                               required=("version", "attempt", "mismatches"), optional=("step",))
SYNC_VERIFY_FAILED = declare("sync_verify_failed", "a weight sync's VERIFY found tensors that differ from the "
                             "trainer's after every retry: engines left drained (the transformers engine rolled back "
                             "to its snapshot; a vLLM engine keeps none and stays paused until a sync passes VERIFY)",
                             by="rlslurm/sync/protocol.py",
                             required=("version", "transport", "attempts", "engine", "mismatches", "rollback"),
                             optional=("step",))
SYNC_FAILED = declare("sync_failed", "a weight-sync stage failed or ran past sync.timeout_s (dead engine, broken "
                      "group)", by="rlslurm/sync/protocol.py", required=("stage", "version", "reason"),
                      optional=("step",))
SYNC_SKIPPED = declare("sync_skipped", "SLURM stops the job: the trained step's sync is left to the next start",
                       by="rlslurm/rl/loop.py", required=("step", "reason"))
STEP_ABANDONED = declare("step_abandoned", "SLURM stops the job mid-step: the step is made again after the requeue",
                         by="rlslurm/rl/loop.py", required=("step", "reason"))
EXPERIENCE_RESTORED = declare("experience_restored", "experience made ahead (rl.max_staleness) came back from the "
                              "checkpoint", by="rlslurm/rl/controller.py", required=("steps",))
TOOL_ERRORS = declare("tool_errors", "tool calls of a step's episodes failed (malformed, unknown tool, bad arguments, "
                      "raised, timed out, too long an output): each was told to the model as a short error and the "
                      "step went on; counts per kind", by="rlslurm/rl/episodes.py",
                      required=("step", "errors", "kinds", "calls"), informational=True)

# -- the reward service -----------------------------------------------------------------------------------

REWARD_ENDPOINT = declare("reward_endpoint", "the controller found the reward component's service URL",
                          by="rlslurm/reward/session.py", required=("url", "job_id", "restart_count", "waited_s"),
                          informational=True)
REWARD_DEGRADED = declare("reward_degraded", "more of a step's responses than reward.degraded_alert_ratio were "
                          "degraded (not scored)", by="rlslurm/reward/client.py",
                          required=("step", "degraded", "total", "ratio", "alert_ratio", "policy", "first_reason"))
REWARD_SERVICE_DIED = declare("reward_service_died", "the reward service process exited",
                              by="rlslurm/reward/supervisor.py", required=("pid", "exit_code"))
REWARD_SERVICE_UNHEALTHY = declare("reward_service_unhealthy", "the reward service failed its health checks in a "
                                   "row and is killed", by="rlslurm/reward/supervisor.py",
                                   required=("pid", "failed_checks"))
REWARD_SERVICE_START_FAILED = declare("reward_service_start_failed", "a restart of the reward service did not "
                                      "come up healthy", by="rlslurm/reward/supervisor.py",
                                      required=("attempt", "error"))
REWARD_SERVICE_RESTARTED = declare("reward_service_restarted", "the supervisor restarted the reward service",
                                   by="rlslurm/reward/supervisor.py",
                                   required=("restarts", "pid", "reason", "start_s", "url"))
REWARD_SERVICE_DOWN = declare("reward_service_down", "the reward service is gone past its restart budget "
                              "(reward.max_restarts): the supervisor gave up", by="rlslurm/reward/supervisor.py",
                              required=("restarts", "attempts", "max_restarts", "reason", "log"))
REWARD_WORKER_DIED = declare("reward_worker_died", "a worker process of the reward service (a user's reward "
                             "function, math-verify) died while scoring: its item is unscored (reward.degrade) and a "
                             "fresh worker takes its slot", by="rlslurm/reward/workers.py",
                             required=("what", "worker_pid", "exit_code"))
REWARD_SERVICE = (REWARD_SERVICE_DIED, REWARD_SERVICE_UNHEALTHY, REWARD_SERVICE_START_FAILED,
                  REWARD_SERVICE_RESTARTED, REWARD_SERVICE_DOWN)
"""What the supervisor says of the service it keeps alive."""


def _declared(kind: EventKind | str) -> EventKind:
    found = KINDS.get(kind if isinstance(kind, str) else getattr(kind, "name", None))
    if found is None or not (isinstance(kind, str) or found == kind):
        raise ValueError(f"event kind {kind!r} is not declared in rlslurm/events.py: declare it there (name, "
                         f"meaning, fields, emitter) and use its constant")
    return found


def emit(run: RunDir, kind: EventKind | str, **fields) -> dict:
    """Append one event of a declared `kind` to `run`'s events.jsonl and return it; raises ValueError for
    an undeclared kind, a missing required field or (unless the kind is open_fields) an undeclared one.
    Code passes the constant; a declared name is accepted too (the event-kind test holds code to constants)."""
    kind = _declared(kind)
    missing = [f for f in kind.required if f not in fields]
    unknown = [f for f in fields if f not in (*BASE_FIELDS, *kind.required, *kind.optional)]
    if missing or (unknown and not kind.open_fields):
        raise ValueError(f"event {kind.name}: missing required fields {missing}, undeclared fields {unknown} "
                         f"(declared: required {list(kind.required)}, optional {list(kind.optional)})")
    record = {
        "t": time.time(),
        "kind": kind.name,
        "host": node_name(),
        "pid": os.getpid(),
        "role": fields.pop("role", os.environ.get("RLSLURM_ROLE", "main")),
        "rank": fields.pop("rank", int(os.environ.get("RLSLURM_RANK", "0"))),
        **fields,
    }
    run.append_json(run.events, record)
    return record


def select(events: Iterable[dict], *kinds: EventKind | str) -> list[dict]:
    """The events of any of `kinds` (each declared), in order."""
    names = {_declared(k).name for k in kinds}
    return [e for e in events if e.get("kind") in names]


def read_events(run: RunDir, kind: EventKind | str | None = None) -> list[dict]:
    """Events of `run` in order, optionally only those of one (declared) kind. Lines of kinds declared no
    more (an older run directory) are kept: a reader that looks for a kind simply does not find them."""
    events = read_jsonl(run.events)
    return events if kind is None else select(events, kind)


def kind_of(event: dict) -> EventKind | None:
    """The declaration of `event`'s kind; None for a kind no longer declared (an older run directory)."""
    return KINDS.get(event.get("kind"))


def markdown() -> str:
    """The table of every declared kind (docs/events.md)."""
    lines = ["# Event kinds", "",
             "Every line of a run's `events.jsonl` is one of these kinds (declared in `rlslurm/events.py`;",
             "this page is its output: `python -m rlslurm.events > docs/events.md`). Every event also carries",
             f"{', '.join(f'`{f}`' for f in BASE_FIELDS)}. Optional fields are in brackets; `...`: more fields",
             "follow (a splat of metrics or of a summary). *informational*: no reader of rlslurm looks for it.", "",
             "| kind | meaning | fields | emitted by |", "|---|---|---|---|"]
    for k in KINDS.values():
        fields = [f"`{f}`" for f in k.required] + [f"[`{f}`]" for f in k.optional] + (["..."] if k.open_fields else [])
        meaning = k.meaning + (" *(informational)*" if k.informational else "")
        lines.append(f"| `{k.name}` | {meaning} | {' '.join(fields)} | {', '.join(k.emitted_by)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
