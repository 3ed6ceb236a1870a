"""The node agent's keeper: notices when the node's watchdog process (diag/watchdog.py) dies, says so, restarts it.

    keeper = AgentKeeper(run, start=lambda: start_node_agent(run, "train"), log_path=..., node=...)
    ...                                    # the ranks work; a thread of this process waits on the agent
    keeper.stop()                          # the job is leaving: terminate the agent; no event

Without it an agent that crashed or was killed (OOM killer, a stray `kill`) left its node unwatched in
silence: no hang there was ever detected, and nothing said why. An agent that exits while the keeper has
not been stopped is a `node_agent_died` event (node, pid, exit code or signal, the tail of its log: the
traceback of a crash), and a new agent is started while `max_restarts` allows; past it the event says
the node's hangs go unwatched (the collectives' and phases' own timeouts still end a real hang). Exits
that are the agent's own decisions are no death: 0 (its ranks are gone, its parent is gone, asked to
stop) and ExitCode.HANG_DETECTED (it acted on a hang).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from pathlib import Path
from typing import Callable

from rlslurm import events
from rlslurm.lifecycle import ExitCode
from rlslurm.rundir import RunDir

log = logging.getLogger("rlslurm.agent")

LOG_TAIL_LINES = 12


def death_cause(returncode: int) -> tuple[str, str | None]:
    """(words, signal name or None) for an agent's exit status as Popen gives it (-N: killed by signal N)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}", name
    return f"exited {returncode}", None


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of the agent's log ("" where there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class AgentKeeper:
    """Waits on the node agent in a thread; its unplanned exit is an event and, within the budget, a restart."""

    def __init__(self, run: RunDir, start: Callable[[], subprocess.Popen], *, log_path: Path, node: str,
                 max_restarts: int = 2):
        self.run, self.start, self.log_path, self.node = run, start, log_path, node
        self.max_restarts = max_restarts
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # stop() and a restart must not cross: stop terminates the newest agent
        self.proc = start()
        self._thread = threading.Thread(target=self._keep, name="node-agent-keeper", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        while True:
            proc = self.proc
            code = proc.wait()
            if self._stopping.is_set() or code in (0, ExitCode.HANG_DETECTED):
                return
            cause, sig = death_cause(code)
            with self._lock:
                restarted = None
                if not self._stopping.is_set() and self.restarts < self.max_restarts:
                    try:
                        restarted = self.start()
                        self.restarts += 1
                    except Exception as e:  # noqa: BLE001 - said in the event; the ranks go on unwatched
                        cause += f"; the restart failed: {type(e).__name__}: {e}"
                fields = {"signal": sig} if sig else {}
                events.emit(self.run, events.NODE_AGENT_DIED, node=self.node, agent_pid=proc.pid, returncode=code,
                            cause=cause, log=str(self.log_path), log_tail=log_tail(self.log_path),
                            restarted=restarted is not None, **fields)
                log.error("node agent pid %d on %s %s; %s", proc.pid, self.node, cause,
                          f"restarted as pid {restarted.pid}" if restarted else f"not restarted ({self.restarts} "
                          f"restarts made, budget {self.max_restarts}): hangs on this node go unwatched")
                if restarted is None:
                    return
                self.proc = restarted

    def stop(self) -> None:
        """The job is leaving: terminate the agent (if it still runs); its exit is no event."""
        with self._lock:
            self._stopping.set()
            if self.proc.poll() is None:
                self.proc.terminate()
