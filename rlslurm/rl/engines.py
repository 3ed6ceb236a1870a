"""The rollout engines the RL controller talks to, and where it finds them.

    engines = Engines(job, run, model_dir)    # announced by the rollout het component, or spawned here
    engines.clients[i].completions(...)       # rlslurm/rollout/client.py's EngineClient
    engines.drain(timeout_s); engines.stop()

On SLURM with separate placement the rollout het component runs the engines (rlslurm/rl/roles.py
`run_engine`) and each announces its URL in <run>/endpoints/engine-<i>.json; colocated (a plain SLURM
job) or off SLURM the controller spawns them beside rank 0. Either way every engine requires the job's
secret (<run>/secret, handed to it as a path) and every client here sends it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from rlslurm import events, lifecycle, secret
from rlslurm.config import JobConfig
from rlslurm.devices import CVD, spawned_engine_env, visible_gpus
from rlslurm.dist import free_port
from rlslurm.errors import RlslurmError
from rlslurm.layout import JobLayout
from rlslurm.network import network_env
from rlslurm.node import node_name
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)


class Engines:
    """The rollout engines the controller talks to: announced by the rollout het component (separate
    placement on SLURM), or spawned here beside rank 0 (colocated, or any run off SLURM), each under its
    supervisor (rlslurm/rollout/supervisor.py), which replaces a dead or hung engine at the same URL.

    Failover (issue 19): an engine whose request fails is taken out of rotation (`take_out`, event
    `engine_out`) and the controller sends its prompts to the others; at the next weight sync an engine its
    supervisor replaced (`returning`) is synced with the others and VERIFIED, and only then takes traffic
    again (`readmit`, event `engine_readmitted`). An engine its supervisor gave up on (`engine_down`, past
    rollout.max_restarts: the budget is per engine) leaves the rotation for good and the others serve on;
    every engine down fails the job naming them (engine_failed; the rank's EngineRequestError, SLURM's
    FAILED 1:0)."""

    def __init__(self, job: JobConfig, layout: JobLayout, run: RunDir, model_dir: Path):
        from rlslurm.rollout.client import EngineRequestError
        from rlslurm.rollout.launcher import connect
        from rlslurm.rollout.supervisor import EngineSupervisor, endpoint_path

        self.run, self.job = run, job
        self.supervisors: list[EngineSupervisor] = []
        secret_file = secret.ensure(run.secret)  # made at submit; a run directory made by hand gets one here
        token = secret.read(secret_file)
        self.identity: dict[str, dict] = {}  # url -> node, pid, log: what an `engine_failed` event names
        if layout.engines_from_component:
            urls = wait_for_endpoints(run, layout.engines, job.rollout.request_timeout_s,
                                      job_id=lifecycle.leader_job_id(), restart_count=lifecycle.restart_count())
            announced = {_read_json(path).get("url"): path for path in (run.path / "endpoints").glob("engine-*.json")}
            self.files = [announced[url] for url in urls]
        else:
            node = node_name()
            self.files = [endpoint_path(run, i) for i in range(layout.engines)]
            threads = spawned_engine_threads(job, layout)
            for i in range(layout.engines):
                # Its own GPUs (the layout's positions among rank 0's) and the job's network environment.
                gpus = spawned_engine_env(layout, i)
                sup = EngineSupervisor(i, engine_launch(job, run, i, model_dir, host="127.0.0.1", env=gpus,
                                                        threads=threads),
                                       job.rollout, run=run, node=node, stamp=endpoint_stamp())
                try:
                    sup.start()
                except EngineRequestError as e:
                    self.identity[sup.url] = {"node": node, "log": str(sup.spec.log_path)}
                    self.failed(e)
                    self.stop()  # the engines started before it
                    raise
                self.supervisors.append(sup)
                # A spawned engine is no SLURM task of its own, so it is recorded here: on SLURM this is
                # where a colocated engine shows it shares the trainer's node.
                run.append_json(run.path / "placement.jsonl", {
                    "t": time.time(), "role": "rollout", "rank": i, "node": node,
                    "partition": os.environ.get("SLURM_JOB_PARTITION"), "job_id": lifecycle.leader_job_id(),
                    "restart_count": lifecycle.restart_count(), "pid": sup.pid, "colocated": True,
                    "cuda_visible_devices": gpus[CVD], "gpus": visible_gpus(gpus)})
            urls = [sup.url for sup in self.supervisors]
        for url, path in zip(urls, self.files):
            record = _read_json(path)
            self.identity[url] = {"node": record.get("node"), "pid": record.get("pid"),
                                  "log": record.get("log") or str(run.logs / "rollout-*.log")}
        # rollout.engine vllm is vLLM's own server, whose client speaks its RL routes (rollout/launcher.py connect).
        self.clients = [connect(url, job.rollout.request_timeout_s, token=token, engine=job.rollout.engine,
                                tp=job.rollout.tp) for url in urls]
        self.live = [True] * len(self.clients)
        self.down: set[int] = set()  # engines their supervisor gave up on: out of rotation for good
        self.generations = [int(_read_json(path).get("generation") or 0) for path in self.files]
        self.version: int | None = None  # what every engine in rotation serves since the last sync
        self._waited: dict[int, int | None] = {}  # engine -> its generation when `returning` waited in vain
        try:
            for client in self.clients:  # an announced engine announces itself before its server listens
                client.wait_ready(job.rollout.request_timeout_s)
        except EngineRequestError as e:
            self.failed(e)
            self.stop()
            raise
        for url, path in zip(urls, self.files):  # serving now: the pid of each server
            self.identity[url]["pid"] = _read_json(path).get("pid") or self.identity[url]["pid"]

    @property
    def processes(self):
        """The spawned engines' server processes (rollout/client.py EngineProcess), as they are now."""
        return [sup.process for sup in self.supervisors if sup.process is not None]

    def admitted(self) -> list[int]:
        """Indices of the engines in rotation, in order."""
        return [i for i, live in enumerate(self.live) if live]

    def record(self, i: int) -> dict:
        """Engine i's announcement (rollout/supervisor.py): url, node, pid, generation, state."""
        return _read_json(self.files[i])

    def check_down(self) -> None:
        """An engine whose supervisor gave up on it (past rollout.max_restarts, the budget of each engine) leaves
        the rotation for good (event `engine_out`, once) and the job goes on with the engines left; only when
        every engine is down raise EngineRequestError (-> engine_failed: the job fails naming them)."""
        from rlslurm.rollout.client import EngineRequestError

        down, said = self.down, ""
        for i, path in enumerate(self.files):
            record = _read_json(path)
            if record.get("state") != "down":
                continue
            url = self.clients[i].url
            said = (f"engine {url}: down: its supervisor gave up on it past rollout.max_restarts = "
                    f"{self.job.rollout.max_restarts} (events engine_down; log {record.get('log')})")
            if i not in down:
                down.add(i)
                self.take_out(i, EngineRequestError(said, url=url, call="supervise"), resent=0)
        if down and len(down) == len(self.clients):
            last = self.clients[max(down)].url
            raise EngineRequestError(f"{said}; no engine left: all {len(down)} down past rollout.max_restarts",
                                     url=last, call="supervise")

    def check_served(self, i: int, answer: dict) -> None:
        """An answer stamped with another policy version than the last sync's comes from an engine replaced
        since (a fresh server serves the initial weights): raise, so its prompts go elsewhere."""
        from rlslurm.rollout.client import EngineRequestError

        served = answer.get("policy_version")
        if self.version is not None and served != self.version:
            url = self.clients[i].url
            raise EngineRequestError(f"engine {url}: answered with policy version {served}, not {self.version} of "
                                     "the last sync: it was replaced since", url=url, call="POST /v1/completions")

    def take_out(self, i: int, error: BaseException, *, resent: int) -> None:
        """Engine i failed a request: out of rotation until a sync readmits it (event `engine_out`)."""
        self.live[i] = False
        url = self.clients[i].url
        fields = {k: v for k, v in self.identity.get(url, {}).items() if k in ("node", "pid") and v is not None}
        for k in ("call", "status"):
            if getattr(error, k, None) is not None:
                fields[k] = getattr(error, k)
        said = str(error).removeprefix(f"engine {url}: ").splitlines()[0][:500]
        log.warning("engine %d (%s) out of rotation, %d prompts re-sent: %s", i, url, resent, said)
        events.emit(self.run, events.ENGINE_OUT, role="controller", engine=i, url=url, cause=said, resent=resent,
                    **fields)

    def unanswering(self, members: list[int]) -> int | None:
        """The first of `members` that gives no healthy /health answer (dead, stopped), or None: the engine a
        failed sync stage lost when no request named it (the trainer's side of a broadcast failed first)."""
        from rlslurm.rollout.client import EngineRequestError

        for i in members:
            client = self.clients[i]
            try:
                getattr(client, "live", client.health)(timeout_s=2.0)  # vLLM: its own /health only
            except EngineRequestError:
                return i
        return None

    def returning(self, poll_s: float = 0.2) -> list[int]:
        """Engines out of rotation that serve again (replaced by their supervisor, or answering /health): the
        next sync takes them along. Waits (bounded by rollout.request_timeout_s) while a supervisor has not
        decided yet: it replaces a dead engine within seconds, a hung one within rollout.hang_timeout_s."""
        from rlslurm.rollout.client import EngineRequestError

        back = []
        for i in [i for i, live in enumerate(self.live) if not live]:
            # Waited for in vain already, and not replaced since (its supervisor itself gone?): one look, no wait.
            waited = i in self._waited and self._waited[i] == self.record(i).get("generation")
            deadline = time.monotonic() + (0 if waited else self.job.rollout.request_timeout_s)
            while True:
                record = self.record(i)
                if record.get("state") == "down":
                    break  # check_down fails the job
                if record.get("state") == "serving":
                    try:
                        self.clients[i].health(timeout_s=2.0)
                        back.append(i)
                        break
                    except EngineRequestError:
                        pass
                if time.monotonic() >= deadline:
                    if not waited:
                        log.warning("engine %d (%s) is not back after %.0f s: it stays out of rotation", i,
                                    self.clients[i].url, self.job.rollout.request_timeout_s)
                    self._waited[i] = record.get("generation")
                    break
                time.sleep(poll_s)
        return back

    def readmit(self, indices: list[int], version: int, step: int | None) -> None:
        """Engines a sync to `version` just verified: in rotation again (event `engine_readmitted`)."""
        for i in indices:
            record = self.record(i)
            self.live[i] = True
            self.generations[i] = int(record.get("generation") or 0)
            self.identity[self.clients[i].url].update(pid=record.get("pid"))
            events.emit(self.run, events.ENGINE_READMITTED, role="controller", engine=i, url=self.clients[i].url,
                        version=version, generation=self.generations[i], **({} if step is None else {"step": step}))

    def metrics(self) -> dict:
        """Per step: engines in rotation, replacements of all engines so far."""
        restarts = sum(int(self.record(i).get("generation") or 0) for i in range(len(self.clients)))
        return {"engines_alive": sum(self.live), "engine_restarts": restarts}

    def drain(self, timeout_s: float) -> None:
        """The engines' part of a job drain: refuse new prompts, finish the ones in flight (bounded).

        The controller calls it once the trainer ranks agreed on the drain step, not the engines on
        their own signal: an engine that refused prompts in the middle of a step would fail that step.
        """
        from rlslurm.rollout.client import EngineRequestError

        states = {}
        for i in self.admitted():
            client = self.clients[i]
            try:
                answer = client.drain(timeout_s)
                states[client.url] = {"state": answer["state"], "waited_s": round(answer["waited_s"], 3),
                                      "version": answer["version"]}
            except EngineRequestError as e:  # the job checkpoints and requeues whatever an engine says
                states[client.url] = {"state": "unknown", "error": str(e)}
        events.emit(self.run, events.ENGINES_DRAINED, role="controller", engines=states)

    def culprit(self, error: BaseException):
        """The EngineRequestError naming an engine behind `error` (raised from one: a sync stage, the
        experience pipeline), or None."""
        from rlslurm.rollout.client import EngineRequestError

        cause: BaseException | None = error
        while cause is not None and not (isinstance(cause, EngineRequestError) and cause.url):
            cause = cause.__cause__ or cause.__context__
        return cause

    def failed(self, error: BaseException) -> bool:
        """Say which engine failed the job (event `engine_failed`: url, node, pid, exit code, log, the call
        and what came back) when `error` is an engine's (an EngineRequestError, or raised from one: a sync
        stage, the experience pipeline) or a spawned engine process has exited; False when neither."""
        cause = self.culprit(error)
        exited = {sup.url: sup.exit_code(sup.pid) for sup in self.supervisors if sup.exit_code(sup.pid) is not None}
        if cause is not None:  # its message without the "engine <url>: " it starts with (the event has the url)
            url, call, said = cause.url, cause.call, str(cause).removeprefix(f"engine {cause.url}: ")
        elif exited:
            url, call, said = next(iter(exited)), None, f"the engine process exited while: {error}"
        else:
            return False
        fields = {k: v for k, v in self.identity.get(url, {}).items() if v is not None}
        code = next((sup.exit_code(fields.get("pid")) for sup in self.supervisors if sup.url == url), None)
        if code is not None:
            fields["exit_code"] = code
        if call is not None:
            fields["call"] = call
        if getattr(cause, "status", None) is not None:
            fields["status"] = cause.status
        log.error("engine %s failed: %s", url, said.splitlines()[0])
        events.emit(self.run, events.ENGINE_FAILED, role="controller", url=url, cause=said.splitlines()[0][:500],
                    **fields)
        return True

    def stop(self) -> None:
        for sup in self.supervisors:
            sup.stop()
        for client in getattr(self, "clients", []):
            client.close()


def endpoint_stamp() -> dict:
    """Which start of the job an announcement belongs to: a requeued job must not take a previous start's URL."""
    return {"job_id": lifecycle.leader_job_id(), "restart_count": lifecycle.restart_count()}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def engine_args(job: JobConfig, threads: int = 1) -> list[str]:
    """Server flags of every engine of the job: `threads` torch CPU threads for the hf engine (vLLM: 1, it places
    itself), the hf engine on the node's GPU where it has one, and with train.lora the trainer's LoRA layers on
    the hf engine (vLLM is sent merged weights: rlslurm/lora.py)."""
    import torch  # here: rank 0 spawns its engines before it imports torch (rlslurm/rl/early.py)

    hf = job.rollout.engine == "hf"
    gpu = hf and torch.cuda.is_available()
    threads = threads if hf else 1
    lora = ["--lora", job.train.lora.to_flag()] if hf and job.train.lora.enabled else []
    return ["--threads", str(threads), *(["--device", "cuda"] if gpu else []), *lora]


def spawned_engine_threads(job: JobConfig, layout: JobLayout, cores: int | None = None) -> int:
    """Torch CPU threads of each hf engine rank 0 spawns beside the trainer: the cores the trainer leaves idle while
    the engines generate, shared between them. `cores`: rank 0's (its affinity: the whole machine off SLURM, its
    task's cores on SLURM). Synchronous (rl.max_staleness 0) every rank waits while the engines generate, so they
    take every core; running ahead, the rollout overlaps training and gets what the ranks on those cores leave
    (one core each, rlslurm/rl/loop.py), at least one thread."""
    cores = cores or len(os.sched_getaffinity(0))
    if job.rl.max_staleness:
        ranks_here = layout.train_tasks_per_node if cores >= (os.cpu_count() or cores) else 1
        cores -= ranks_here
    return max(1, cores // max(1, layout.engines))


def engine_limits(job: JobConfig) -> list[str]:
    """Server flags of the limits of one request (rollout.* keys; by default the most the job itself
    asks: k samples of a whole step's prompts, or the held-out set at once), its deadline and stall timeout."""
    # An evaluation asks for rl.eval_rows of a user's held-out rows at once (task: its task.eval_size problems).
    eval_prompts = job.rl.eval_rows if job.data.train is not None else job.task.eval_size
    return job.rollout.server_args(samples_per_prompt=job.rl.samples_per_prompt,
                                   prompts_per_request=job.rl.prompts_per_step, eval_prompts=eval_prompts)


def _passive_threads(threads: int) -> dict[str, str]:
    """OMP_WAIT_POLICY=PASSIVE for an engine of more than one thread (unless the job's environment sets it): torch's
    OpenMP threads then sleep between parallel regions instead of spinning. Measured on 2 cores at load ~10
    (other work beside the job): 64 prompts x 8 in 363 ms on one thread, 2,938 ms on two spinning, 192 ms on
    two passive; a spinning thread that lost its core holds up every parallel region of the rest."""
    return {"OMP_WAIT_POLICY": "PASSIVE"} if threads > 1 and "OMP_WAIT_POLICY" not in os.environ else {}


def preload_env(job: JobConfig, layout: JobLayout) -> dict[str, str]:
    """What libraries read from the environment at load, as rank 0's spawned hf engines need it: the local
    supervisor imports torch with it before it forks the ranks, whose first engine is forked from rank 0
    (rlslurm/prefork.py), so libgomp has read OMP_WAIT_POLICY before the engine exists. The ranks train on one
    thread (rlslurm/rl/loop.py): a wait policy does nothing to them."""
    if job.job.kind != "rl" or job.rollout.engine != "hf" or layout.engines_from_component:
        return {}
    return _passive_threads(spawned_engine_threads(job, layout))


def engine_launch(job: JobConfig, run: RunDir, index: int, model_dir: Path, *, host: str,
                  env: dict[str, str] | None = None, threads: int = 1):
    """How engine `index` of the job is started, the same by the controller (spawned engines) and by the
    rollout component (rlslurm/rl/roles.py): flags (`threads`: the hf engine's torch CPU threads), limits, phase
    guard (role rollout, rank `index`), the job's secret, network environment and engine."""
    from rlslurm.rollout.supervisor import EngineLaunch

    threads = threads if job.rollout.engine == "hf" else 1  # vLLM places its own threads
    guard = ["--run-dir", str(run.path), "--rank", str(index),
             "--heartbeat-interval-s", f"{job.diag.heartbeat_interval_s:g}",
             "--phase-timeout-s", f"{job.diag.timeout_for('rollout'):g}"]
    return EngineLaunch(model_dir=model_dir, host=host, port=free_port(), log_path=run.logs / f"engine-{index}.log",
                        secret_file=run.secret, args=(*engine_args(job, threads), *engine_limits(job), *guard),
                        env={"RLSLURM_RUN_DIR": str(run.path), "RLSLURM_ROLE": "rollout", "RLSLURM_RANK": str(index),
                             # the vLLM engine's share of a GPU (rollout/vllm_serve.py)
                             "RLSLURM_GPU_MEMORY_UTILIZATION": str(job.rollout.gpu_memory_utilization),
                             **_passive_threads(threads), **network_env(job.network), **(env or {})},
                        engine=job.rollout.engine, python=job.rollout.python, tp=job.rollout.tp,
                        ready_timeout_s=job.rollout.request_timeout_s, request_timeout_s=job.rollout.request_timeout_s)


def wait_for_endpoints(run: RunDir, count: int, timeout_s: float, *, job_id: str | None, restart_count: int,
                       poll_s: float = 0.5) -> list[str]:
    """URLs of `count` engines of this start of the job, from <run>/endpoints/engine-*.json (polled,
    bounded). A requeued job finds the files of its previous allocation there until its new engines
    overwrite them: only files stamped with this job id and restart count count."""
    folder = run.path / "endpoints"
    deadline = time.monotonic() + timeout_s
    while True:
        found, stale = [], 0
        for path in sorted(folder.glob("engine-*.json")) if folder.is_dir() else []:
            record = json.loads(path.read_text())
            if (record.get("job_id"), record.get("restart_count")) == (job_id, restart_count):
                found.append(record["url"])
            else:
                stale += 1
        if len(found) >= count:
            return found[:count]
        if time.monotonic() > deadline:
            raise RlslurmError(f"only {len(found)} of {count} rollout engines of job {job_id} restart {restart_count} "
                               f"announced themselves in {folder} within {timeout_s:.0f} s ({stale} stale files "
                               f"of earlier starts); see {run.logs}/rollout-*.log")
        log.info("waiting for %d engine endpoints in %s (%d so far, %d stale)", count, folder, len(found), stale)
        time.sleep(poll_s)

