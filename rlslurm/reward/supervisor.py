"""Keeps the reward service alive: starts it, health-checks it, restarts it when dead or unhealthy.

    with RewardSupervisor(cfg.reward, run=RunDir(path)) as sup:    # blocks until /health answers
        client = RewardClient(cfg.reward, sup.url, run=...)
        ...

Lifecycle: `start()` launches `python -m rlslurm.reward.service` on 127.0.0.1 (the port is chosen
once and kept, so clients' retries land on the restarted process at the same URL) and waits for
/health; a monitor thread then checks every `health_interval_s` (waiting on an Event, so `stop()`
ends it at once): a process that exited is restarted at once (event `reward_service_died`), one that
fails `unhealthy_after` health checks in a row (hung, stopped) is killed and restarted (event
`reward_service_unhealthy`); each new process writes `reward_service_restarted`. Past `max_restarts`
it gives up (event `reward_service_down`: restarts, the budget, the service's log) and `failed` is set.
`stop()` asks the service to exit (SIGTERM: its heartbeat ends `exited`), then kills its process group.
The service is in a session of its own (that group); SLURM's signals to the step still reach it (measured on
22.05 with proctrack/linuxproc: USR1, a suspend's SIGTSTP and SIGSTOP, a requeue's SIGTERM reach every process
of the step's tree), so a suspend stops it with the ranks, and a SIGTERM ends it cleanly: a service that exits
0 was stopped that way and is not a death to restart (issue 38: every drain on SIGTERM said
`reward_service_died`, exit code 0; `stopping()` says so too, from the owner's SIGTERM handler). It ends
itself when this process is gone (rlslurm/lifetime.py), a SIGKILLed trainer rank 0 included.

With a run directory the service wears the phase guard (heartbeats/reward-0.json, see service.py) and
requires the run's secret (<run>/secret; without a run, a secret file of its own beside its log, mode
0600; `token` is what clients send). `bind` is the address the service listens on and `url` points at
it: the node's address for the reward het component (its peers are on other nodes), loopback beside
the controller. `env` is added to the service's environment at every (re)start: the job's network
environment (rlslurm/network.py) and no GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import httpx
import yaml

from rlslurm import events, lifetime, secret
from rlslurm.configfile import to_dict
from rlslurm.diag.config import DiagConfig
from rlslurm.errors import RewardServiceError
from rlslurm.reward.config import RewardConfig
from rlslurm.rundir import RunDir

log = logging.getLogger(__name__)

STOPPING_GRACE_S = 2.0
"""Seconds a service that stopped answering /health is given to exit by itself before it counts as hung."""


def free_port() -> int:
    """A port nobody listens on now (the service binds it with SO_REUSEADDR, so restarts keep it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RewardSupervisor:
    """One supervised reward service process; see the module docstring for its lifecycle."""

    def __init__(self, cfg: RewardConfig, run: RunDir | None = None, log_dir: str | Path | None = None,
                 clock: Callable[[], float] = time.monotonic, bind: str = "127.0.0.1",
                 diag: DiagConfig | None = None, secret_file: str | Path | None = None,
                 env: Mapping[str, str] | None = None):
        self.cfg = cfg
        self.env = dict(env or {})
        self.run = run
        self.clock = clock
        self.bind = bind
        self.port = cfg.port or free_port()
        self.url = f"http://{'127.0.0.1' if bind in ('0.0.0.0', '') else bind}:{self.port}"
        self.restarts = 0  # restarts that came up healthy
        self._attempts = 0  # restarts tried, the ones that failed to start included
        self.failed = threading.Event()
        self.proc: subprocess.Popen | None = None
        self._stop = lifetime.StopFlag()  # `stopping` runs in a SIGTERM handler
        self._thread: threading.Thread | None = None
        self._dir = Path(log_dir) if log_dir else (run.logs if run else Path(tempfile.mkdtemp(prefix="reward-")))
        self._dir.mkdir(parents=True, exist_ok=True)
        self.secret_file = secret.ensure(secret_file or (run.secret if run is not None
                                                         else self._dir / "reward-service.secret"))
        self.token = secret.read(self.secret_file)
        self.log_path = self._dir / "reward-service.log"  # stdout + stderr of every start, appended
        self._config = self._dir / "reward-service.yaml"
        self._config.write_text(yaml.safe_dump({"reward": to_dict(cfg), "diag": to_dict(diag or DiagConfig())}))
        self._http = httpx.Client(timeout=cfg.health_timeout_s)

    def __enter__(self) -> "RewardSupervisor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _event(self, kind: events.EventKind, **fields) -> None:
        log.warning("%s %s", kind.name, fields)
        if self.run is not None:
            events.emit(self.run, kind, role="reward", **fields)

    def start(self) -> None:
        """Launch the service, wait until it is healthy, then start the monitor thread."""
        self._launch()
        self._thread = threading.Thread(target=self._monitor, name="reward-supervisor", daemon=True)
        self._thread.start()

    def stopping(self) -> None:
        """The service is being stopped from outside (SLURM's SIGTERM reaches it too): no more restarts."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # uvicorn exits cleanly and the service's guard writes `exited`
            try:
                self.proc.wait(timeout=5)
                os.killpg(self.proc.pid, signal.SIGKILL)  # sandboxed programs left in its process group
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        self._kill()
        self._http.close()

    def healthy(self) -> bool:
        try:
            return self._http.get(self.url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _launch(self) -> bool:
        """Start the service and wait for /health: True once healthy, False when stop() came first."""
        out = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "rlslurm.reward.service", "--port", str(self.port), "--host", self.bind,
                "--secret-file", str(self.secret_file), "--config", str(self._config)]
        if self.run is not None:
            argv += ["--run-dir", str(self.run.path)]
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **self.env, **lifetime.child_env()})
        out.close()
        deadline = self.clock() + self.cfg.start_timeout_s
        log.info("waiting up to %.0f s for the reward service (pid %d) on %s", self.cfg.start_timeout_s,
                 self.proc.pid, self.url)
        while not self.healthy():
            if self.proc.poll() is not None or self.clock() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self._kill()
                raise RewardServiceError(
                    f"reward service on {self.url} not healthy within {self.cfg.start_timeout_s:g} s "
                    f"(exit code {self.proc.returncode}); log {self.log_path} ends:\n{tail}")
            if self._stop.wait(0.1):
                return False
        return True

    def _exits_within(self, timeout_s: float) -> bool:
        """Whether the service exits by itself within `timeout_s` (a clean shutdown stops answering /health
        before it exits: not a hang to kill)."""
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the service and its sandboxes
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def _restart(self, why: str) -> bool:
        if self._attempts >= self.cfg.max_restarts:
            self._event(events.REWARD_SERVICE_DOWN, restarts=self.restarts, attempts=self._attempts,
                        max_restarts=self.cfg.max_restarts, reason=why, log=str(self.log_path))
            self.failed.set()
            return False
        self._kill()
        self._attempts += 1
        started = self.clock()
        try:
            if not self._launch():
                return False
        except RewardServiceError as e:
            self._event(events.REWARD_SERVICE_START_FAILED, attempt=self._attempts, error=str(e)[:500])
            return True  # the monitor's next round sees it dead and tries again
        self.restarts += 1
        self._event(events.REWARD_SERVICE_RESTARTED, restarts=self.restarts, pid=self.proc.pid, reason=why,
                    start_s=round(self.clock() - started, 3), url=self.url)
        return True

    def _monitor(self) -> None:
        failures = 0
        while not self._stop.wait(self.cfg.health_interval_s):
            code = self.proc.poll()
            if code is not None and (code == 0 or self._stop.is_set()):
                # Exit 0 is uvicorn's clean shutdown on SIGTERM: SLURM stopping the step (every drain on SIGTERM
                # said `reward_service_died` with exit code 0 before, issue 38), not a death to restart.
                log.info("reward service (pid %d) exited %d: stopped from outside, not restarted", self.proc.pid,
                         code)
                return
            if code is not None:
                self._event(events.REWARD_SERVICE_DIED, pid=self.proc.pid, exit_code=code)
                failures = 0
                if not self._restart("died"):
                    return
                continue
            if self.healthy():
                failures = 0
                continue
            failures += 1
            log.warning("reward service health check failed (%d of %d)", failures, self.cfg.unhealthy_after)
            if failures >= self.cfg.unhealthy_after and self._exits_within(STOPPING_GRACE_S):
                continue  # it was shutting down (a SIGTERM from outside): the poll above says how it ended
            if failures >= self.cfg.unhealthy_after:
                self._event(events.REWARD_SERVICE_UNHEALTHY, pid=self.proc.pid, failed_checks=failures)
                failures = 0
                if not self._restart("unhealthy"):
                    return
