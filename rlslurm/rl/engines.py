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

import torch

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
    placement on SLURM), or spawned here beside rank 0 (colocated, or any run off SLURM)."""

    def __init__(self, job: JobConfig, layout: JobLayout, run: RunDir, model_dir: Path):
        from rlslurm.rollout.client import EngineRequestError, connect, spawn_engine

        self.run = run
        self.processes = []
        secret_file = secret.ensure(run.secret)  # made at submit; a run directory made by hand gets one here
        self.identity: dict[str, dict] = {}  # url -> node, pid, log: what an `engine_failed` event names
        if layout.engines_from_component:
            urls = wait_for_endpoints(run, layout.engines, job.rollout.request_timeout_s,
                                      job_id=lifecycle.leader_job_id(), restart_count=lifecycle.restart_count())
            announced = {r.get("url"): r for r in map(_read_json, (run.path / "endpoints").glob("engine-*.json"))}
            self.identity = {url: {"node": announced.get(url, {}).get("node"), "pid": announced.get(url, {}).get("pid"),
                                   "log": str(run.logs / "rollout-*.log")} for url in urls}
            token = secret.read(secret_file)
            self.clients = [connect(url, job.rollout.request_timeout_s, token=token, engine=job.rollout.engine,
                                    tp=job.rollout.tp) for url in urls]
            try:
                for client in self.clients:  # an engine announces itself before its server listens
                    client.wait_ready(job.rollout.request_timeout_s)
            except EngineRequestError as e:
                self.failed(e)
                raise
        else:
            node = node_name()
            for i in range(layout.engines):
                port, log_path = free_port(), run.logs / f"engine-{i}.log"
                self.identity[f"http://127.0.0.1:{port}"] = {"node": node, "log": str(log_path)}
                # Its own GPUs (the layout's positions among rank 0's) and the job's network environment.
                gpus = spawned_engine_env(layout, i)
                try:
                    proc = spawn_engine(model_dir, port=port, log_path=log_path, secret_file=secret_file,
                                        extra_args=engine_args(job) + engine_limits(job),
                                        env={"RLSLURM_RUN_DIR": str(run.path), "RLSLURM_ROLE": "rollout",
                                             "RLSLURM_RANK": str(i),
                                             # the vLLM engine's share of a GPU (rollout/vllm_engine.py)
                                             "RLSLURM_GPU_MEMORY_UTILIZATION": str(job.rollout.gpu_memory_utilization),
                                             **network_env(job.network), **gpus},
                                        timeout_s=job.rollout.request_timeout_s,
                                        engine=job.rollout.engine, python=job.rollout.python, tp=job.rollout.tp)
                except EngineRequestError as e:
                    self.failed(e)
                    self.stop()  # the engines started before it
                    raise
                self.identity[proc.url]["pid"] = proc.proc.pid
                self.processes.append(proc)
                # A spawned engine is no SLURM task of its own, so it is recorded here: on SLURM this is
                # where a colocated engine shows it shares the trainer's node.
                run.append_json(run.path / "placement.jsonl", {
                    "t": time.time(), "role": "rollout", "rank": i, "node": node,
                    "partition": os.environ.get("SLURM_JOB_PARTITION"), "job_id": lifecycle.leader_job_id(),
                    "restart_count": lifecycle.restart_count(), "pid": proc.proc.pid, "colocated": True,
                    "cuda_visible_devices": gpus[CVD], "gpus": visible_gpus(gpus)})
            self.clients = [p.client for p in self.processes]

    def drain(self, timeout_s: float) -> None:
        """The engines' part of a job drain: refuse new prompts, finish the ones in flight (bounded).

        The controller calls it once the trainer ranks agreed on the drain step, not the engines on
        their own signal: an engine that refused prompts in the middle of a step would fail that step.
        """
        from rlslurm.rollout.client import EngineRequestError

        states = {}
        for client in self.clients:
            try:
                answer = client.drain(timeout_s)
                states[client.url] = {"state": answer["state"], "waited_s": round(answer["waited_s"], 3),
                                      "version": answer["version"]}
            except EngineRequestError as e:  # the job checkpoints and requeues whatever an engine says
                states[client.url] = {"state": "unknown", "error": str(e)}
        events.emit(self.run, events.ENGINES_DRAINED, role="controller", engines=states)

    def failed(self, error: BaseException) -> bool:
        """Say which engine failed the job (event `engine_failed`: url, node, pid, exit code, log, the call
        and what came back) when `error` is an engine's (an EngineRequestError, or raised from one: a sync
        stage, the experience pipeline) or a spawned engine process has exited; False when neither."""
        from rlslurm.rollout.client import EngineRequestError

        cause: BaseException | None = error
        while cause is not None and not (isinstance(cause, EngineRequestError) and cause.url):
            cause = cause.__cause__ or cause.__context__
        exited = {p.url: p.proc.poll() for p in self.processes if p.proc.poll() is not None}
        if cause is not None:  # its message without the "engine <url>: " it starts with (the event has the url)
            url, call, said = cause.url, cause.call, str(cause).removeprefix(f"engine {cause.url}: ")
        elif exited:
            url, call, said = next(iter(exited)), None, f"the engine process exited while: {error}"
        else:
            return False
        fields = {k: v for k, v in self.identity.get(url, {}).items() if v is not None}
        if url in exited:
            fields["exit_code"] = exited[url]
        if call is not None:
            fields["call"] = call
        if getattr(cause, "status", None) is not None:
            fields["status"] = cause.status
        log.error("engine %s failed: %s", url, said.splitlines()[0])
        events.emit(self.run, events.ENGINE_FAILED, role="controller", url=url, cause=said.splitlines()[0][:500],
                    **fields)
        return True

    def stop(self) -> None:
        for proc in self.processes:
            proc.stop()
        for client in getattr(self, "clients", []):
            client.close()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def engine_args(job: JobConfig) -> list[str]:
    """Server flags of every engine of the job: one torch CPU thread, and the hf engine on the node's GPU
    where it has one (vLLM places itself)."""
    gpu = job.rollout.engine == "hf" and torch.cuda.is_available()
    return ["--threads", "1", *(["--device", "cuda"] if gpu else [])]


def engine_limits(job: JobConfig) -> list[str]:
    """Server flags of the limits of one request (rollout.* keys; by default the most the job itself
    asks: k samples of a whole step's prompts, or the held-out set at once), its deadline and stall timeout."""
    return job.rollout.server_args(samples_per_prompt=job.rl.samples_per_prompt,
                                   prompts_per_request=job.rl.prompts_per_step, eval_prompts=job.task.eval_size)


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

