"""Keeps one rollout engine server alive inside the allocation: starts it, health-checks it, replaces it when
it dies or hangs, within a budget (rollout.max_restarts).

    sup = EngineSupervisor(0, EngineLaunch(model_dir=d, host=h, port=p, log_path=..., ...), job.rollout, run=run)
    sup.start()                  # blocks until the server answers /health; announces it
    sup.url, sup.generation      # the URL never changes; the generation counts replacements
    sup.stop()

Modelled on the reward service's supervisor (rlslurm/reward/supervisor.py): the server is a child process
started by one function (`launch`: rollout/launcher.py's spawn_engine, whatever server that starts), on a
port chosen once and kept, so the controller's client reaches the replacement at the same URL. A monitor
thread checks every `rollout.health_interval_s`: a process that exited is replaced at once (event
`engine_died`); one without a healthy /health answer for `rollout.hang_timeout_s` (SIGSTOP, a wedged loop,
the server's own 503 of a stalled generation) is SIGKILLed and replaced (event `engine_unhealthy`, with
the process state: `stopped` for SIGSTOP). vLLM's server answers /health from its API process while its
EngineCore (a child) may be stopped or wedged: for it the supervisor also reads vLLM's Prometheus /metrics,
and requests pending with the generated-token counter unchanged for `rollout.hang_timeout_s` is a hang too
(its cause says so; rollout/vllm_metrics.py). Killing it is also what frees the controller: its request in
flight to the hung engine fails at once (connection reset) instead of at rollout.request_timeout_s, so
the prompts go to the engines left. Each replacement writes `engine_restarted`; past the budget the
supervisor gives up (`engine_down`) and sets `failed`.

Every state is announced in <run>/endpoints/engine-<index>.json {url, node, pid, generation, state:
starting | serving | down, job_id, restart_count}: the controller reads it to take a replaced engine back
(only after a weight sync to that engine passed VERIFY: a fresh server serves the initial weights).

One code path: the controller runs one supervisor per spawned engine (colocated, or off SLURM) in its own
process (rlslurm/rl/engines.py), and each task of the rollout het component runs one around its engine
(rlslurm/rl/roles.py run_engine). The engine itself wears the phase guard as role `rollout`, rank
`index` (rollout/server.py --run-dir), so the node agent and live stack dumps cover it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from rlslurm import events
from rlslurm.lifetime import StopFlag
from rlslurm.rollout.client import EngineProcess, EngineRequestError
from rlslurm.rollout.config import RolloutConfig
from rlslurm.rollout.launcher import spawn_engine
from rlslurm.rollout.vllm_metrics import ProgressWatch
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)

class _NoHealthLines(logging.Filter):
    """httpx logs every request at INFO: a health check per engine per second would bury the process's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "/health" not in record.getMessage()


logging.getLogger("httpx").addFilter(_NoHealthLines())

HEALTH_TIMEOUT_S = 2.0
"""Bound of one health check (less where rollout.hang_timeout_s is short): a stopped engine is declared hung
at most hang_timeout_s + this + one interval after its last healthy answer."""


@dataclass(frozen=True, kw_only=True)
class EngineLaunch:
    """Everything that starts one engine server; the same at every (re)start."""

    model_dir: Path
    """The HF model directory it loads (the initial weights; the controller syncs it afterwards)."""
    host: str
    """Address it binds and is reached at."""
    port: int
    """Port it listens on, kept across restarts."""
    log_path: Path
    """Its stdout + stderr, appended at every start."""
    secret_file: Path
    """The job's secret (a path: argv and env are visible to `ps`)."""
    args: tuple[str, ...] = ()
    """Further server flags: threads, device, request limits, phase guard."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to its environment: role and rank, GPUs, the job's network environment."""
    engine: str = "hf"
    """rollout.engine."""
    python: str | None = None
    """rollout.python: its interpreter (None = this one)."""
    tp: int = 1
    """rollout.tp: a vLLM server's tensor-parallel workers."""
    ready_timeout_s: float = 120.0
    """Seconds a start may take to answer /health (rollout.request_timeout_s)."""
    request_timeout_s: float = 120.0
    """The client's default timeout of one call."""


def launch(spec: EngineLaunch) -> EngineProcess:
    """The one way an engine server is started (first start and every replacement)."""
    return spawn_engine(spec.model_dir, port=spec.port, host=spec.host, log_path=spec.log_path,
                        secret_file=spec.secret_file, extra_args=list(spec.args), env=spec.env,
                        ready_timeout_s=spec.ready_timeout_s, timeout_s=spec.request_timeout_s,
                        engine=spec.engine, python=spec.python, tp=spec.tp)


def endpoint_path(run: RunDir, index: int) -> Path:
    return run.path / "endpoints" / f"engine-{index}.json"


def read_endpoint(path: Path) -> dict:
    """An engine's announcement, or {} while none is readable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def process_state(pid: int) -> str:
    """psutil's state of a process (`stopped` after SIGSTOP), or `gone`."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


def kill_tree(pid: int) -> None:
    """SIGKILL a server and its children (vLLM's EngineCore and workers); a stopped process dies of it too."""
    try:
        proc = psutil.Process(pid)
        family = [*proc.children(recursive=True), proc]
    except psutil.Error:
        return
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(family, timeout=10)


class EngineSupervisor:
    """One supervised engine server; see the module docstring for its lifecycle."""

    def __init__(self, index: int, spec: EngineLaunch, cfg: RolloutConfig, *, run: RunDir | None = None,
                 node: str = "", stamp: dict | None = None, clock: Callable[[], float] = time.monotonic,
                 start: Callable[[EngineLaunch], EngineProcess] = launch):
        self.index, self.spec, self.cfg, self.run, self.node = index, spec, cfg, run, node
        self.stamp = dict(stamp or {})  # job_id, restart_count: which start of the job announces
        self.clock, self._start = clock, start
        self.url = f"http://{spec.host}:{spec.port}"
        self.process: EngineProcess | None = None
        self.generation = 0  # replacements that came up healthy
        self._attempts = 0  # replacements tried, failed starts included
        self.exits: dict[int, int] = {}  # pid -> exit code of every server that ended under us
        self.failed = threading.Event()
        self._stop = StopFlag()  # `stopping` runs in a SIGTERM handler
        self._thread: threading.Thread | None = None
        self._progress: ProgressWatch | None = None  # vLLM: its token counter against pending requests

    @property
    def pid(self) -> int | None:
        return self.process.proc.pid if self.process is not None else None

    def start(self) -> "EngineSupervisor":
        """Start the server (raises EngineRequestError when it does not become healthy), then watch it."""
        self._announce("starting")
        self.process = self._start(self.spec)
        self._announce("serving")
        self._thread = threading.Thread(target=self._monitor, name=f"engine-{self.index}-supervisor", daemon=True)
        self._thread.start()
        return self

    def stopping(self) -> None:
        """The server is being stopped from outside (SLURM's SIGTERM reaches it too): no more replacements."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.process is not None and self.process.proc.poll() is None:
            if process_state(self.process.proc.pid) == psutil.STATUS_STOPPED:
                kill_tree(self.process.proc.pid)  # SIGTERM stays pending on a stopped process
            self.process.stop()

    def exit_code(self, pid: int | None) -> int | None:
        """How server `pid` ended (None while it runs, or if it was not ours)."""
        if self.process is not None and self.process.proc.pid == pid:
            return self.process.proc.poll()
        return self.exits.get(pid) if pid is not None else None

    def _event(self, kind: events.EventKind, **fields) -> None:
        log.warning("engine %d: %s %s", self.index, kind.name, fields)
        if self.run is not None:
            events.emit(self.run, kind, role="rollout", rank=self.index, **fields)

    def _announce(self, state: str) -> None:
        """<run>/endpoints/engine-<index>.json, atomically (the controller polls it)."""
        if self.run is None:
            return
        path = endpoint_path(self.run, self.index)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"url": self.url, "node": self.node, "pid": self.pid, "index": self.index,
                                   "generation": self.generation, "state": state, "log": str(self.spec.log_path),
                                   **self.stamp}))
        os.replace(tmp, path)

    def _healthy(self) -> bool:
        client = self.process.client
        # vLLM's server: its own /health only (rlslurm's health() also asks the EngineCore whether it is paused).
        check = getattr(client, "live", client.health)
        try:
            check(timeout_s=min(HEALTH_TIMEOUT_S, self.cfg.hang_timeout_s / 3))
            return True
        except EngineRequestError:
            return False

    def _stalled(self) -> str | None:
        """vLLM's server: the cause when its Prometheus counters say requests are pending and no token came for
        rollout.hang_timeout_s (rollout/vllm_metrics.py: its EngineCore may be stopped while /health answers)."""
        read = getattr(self.process.client, "progress", None)
        if read is None:
            return None
        if self._progress is None:
            self._progress = ProgressWatch(self.cfg.hang_timeout_s)
        try:
            progress = read(timeout_s=min(HEALTH_TIMEOUT_S, self.cfg.hang_timeout_s / 3))
        except (EngineRequestError, ValueError) as e:
            log.warning("engine %d: /metrics unreadable: %s", self.index, e)
            return None
        return self._progress.update(progress, self.clock())

    def _monitor(self) -> None:
        last_ok = self.clock()
        while not self._stop.wait(self.cfg.health_interval_s):
            if self.process is None:  # the last replacement did not start: try again
                if not self._replace("start failed"):
                    return
                last_ok = self.clock()
                continue
            pid, code = self.process.proc.pid, self.process.proc.poll()
            if code is not None:
                if self._stop.is_set():  # SLURM's SIGTERM reached the server before our stop()
                    return
                self.exits[pid] = code
                self._event(events.ENGINE_DIED, engine=self.index, node=self.node, pid=pid, exit_code=code,
                            url=self.url, log=str(self.spec.log_path), **({"signal": -code} if code < 0 else {}))
                if not self._replace("died"):
                    return
                last_ok = self.clock()
                continue
            healthy = self._healthy()
            stalled = self._stalled() if healthy else None
            if healthy and stalled is None:
                last_ok = self.clock()
                continue
            silent_s = self.clock() - last_ok
            if self._stop.is_set() or (stalled is None and silent_s < self.cfg.hang_timeout_s):
                continue
            state = process_state(pid)
            self._event(events.ENGINE_UNHEALTHY, engine=self.index, node=self.node, pid=pid, url=self.url,
                        unhealthy_s=round(silent_s, 2), process_state=state, log=str(self.spec.log_path),
                        cause=stalled or f"no healthy /health answer for {silent_s:.1f} s (rollout.hang_timeout_s = "
                                         f"{self.cfg.hang_timeout_s:g})")
            self._progress = None
            kill_tree(pid)
            self.exits[pid] = self.process.proc.wait(timeout=10)
            if not self._replace("hung"):
                return
            last_ok = self.clock()

    def _replace(self, why: str) -> bool:
        """A new server in place of the last one: True while the monitor goes on, False once it gave up."""
        if self._attempts >= self.cfg.max_restarts:
            self._event(events.ENGINE_DOWN, engine=self.index, node=self.node, restarts=self.generation,
                        max_restarts=self.cfg.max_restarts, reason=why, log=str(self.spec.log_path))
            self._announce("down")
            self.failed.set()
            return False
        if self.process is not None:
            if self.process.proc.poll() is None:  # a pid Popen has reaped may belong to another process by now
                kill_tree(self.process.proc.pid)
            self.process.client.close()
        self._attempts += 1
        self._announce("starting")
        started = self.clock()
        try:
            self.process = self._start(self.spec)
        except EngineRequestError as e:
            self.process = None
            self._event(events.ENGINE_START_FAILED, engine=self.index, attempt=self._attempts, error=str(e)[:500])
            return True
        self.generation += 1
        self._announce("serving")
        self._event(events.ENGINE_RESTARTED, engine=self.index, node=self.node, pid=self.process.proc.pid,
                    generation=self.generation, url=self.url, reason=why, start_s=round(self.clock() - started, 3))
        return True
