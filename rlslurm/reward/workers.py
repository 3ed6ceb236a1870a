"""Worker processes of the reward service: Python it must not run on its own event loop or threads.

    pool = WorkerPool(["--function", "/abs/rewards.py:compute_score"], size=2, what="reward.function")
    reply = await pool.call({"data_source": "gsm8k", ...})     # {"score": x | None, "reason": "..."}
    await pool.close()

    python -m rlslurm.reward.worker --function FILE.py:NAME     # one worker (the pool starts it: worker.py)
    python -m rlslurm.reward.worker --math                      # math-verify (rule scorer, math_answers.py)

Why processes: a user's reward function (reward.scorer: function) or a sympy parse (math-verify) can run
forever, and Python cannot stop a thread; one stuck in the service's thread pool would hold it until
every slot is gone and /health stops answering. A worker is killed instead (SIGKILL to its process group)
when its call is cancelled (the service's per-item `reward.timeout_s`) and a fresh one takes its place
at the next call. In a worker the call runs on its main thread, so math-verify's own signal.alarm()
timeouts work there (they refuse to run off the main thread).

Wire: one JSON line per call each way, over the worker's stdin and stdout (local pipes, no pickle);
the worker first answers one line {"ready": true} or {"error": "..."} once its code is imported. It
moves anything the user's code prints to stderr (the service's log), so stdout carries only replies.

The worker's side of that wire is `serve_lines`, shared with the tool box's workers (rlslurm/tools/worker.py),
whose pool is this one too.

Lifecycle: workers start on first use (a rule scorer on plain numbers never starts one), live as long
as the pool, and die with the service: `lifetime.bind_to_parent` in each (parent-death SIGKILL when
spawned from the service's main thread, and the getppid() watch).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any, Callable

from rlslurm import lifetime

READY_TIMEOUT_S = 60.0
"""Seconds a new worker may take to import its code (sympy alone is ~1-2 s on a busy 2-core box)."""
LINE_LIMIT = 1 << 20
"""Longest reply line read from a worker, bytes: a reply is a score and a short reason."""
REASON_CHARS = 300
"""A reason is cut to this in the worker (the service cuts again): it must not carry a response back."""


class WorkerFailed(Exception):
    """A worker died or answered garbage in the middle of a call (the call's item cannot be scored)."""


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    def kill(self) -> None:
        # Its own process group: whatever the user's code started goes with it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class WorkerPool:
    """Up to `size` workers of one kind, each doing one call at a time; callers queue for an idle one."""

    def __init__(self, args: list[str], size: int, what: str, *, module: str = "rlslurm.reward.worker",
                 stderr=None):
        # module: the worker's entry (rlslurm/tools/worker.py for a user's tool); stderr: where what the user's
        # code prints goes (None: this process's stderr)
        self.args, self.size, self.what, self.module, self.stderr = list(args), size, what, module, stderr
        self._idle: asyncio.Queue | None = None
        self._all: set[_Worker] = set()
        self._reaping: set[asyncio.Future] = set()
        self.replaced = 0
        """Workers killed (timeout, cancel) or found dead and replaced: for /metrics and tests."""

    def _queue(self) -> asyncio.Queue:
        # Made on first use, inside the service's running loop (a Queue binds to the loop that uses it).
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.size):
                self._idle.put_nowait(None)  # a slot whose worker starts when a call takes it
        return self._idle

    async def _spawn(self) -> _Worker:
        env = {**os.environ, **lifetime.child_env()}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, *self.args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=self.stderr, env=env, start_new_session=True, limit=LINE_LIMIT)
        worker = _Worker(proc)
        self._all.add(worker)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
            hello = json.loads(line) if line else {"error": f"exited with {await proc.wait()} before it was ready"}
        except BaseException:
            self._drop(worker)
            raise
        if not hello.get("ready"):
            self._drop(worker)
            raise WorkerFailed(f"{self.what} worker could not start: {hello.get('error')}")
        return worker

    def _drop(self, worker: _Worker, replaced: bool = True) -> None:
        worker.kill()
        self._all.discard(worker)
        self.replaced += replaced
        # Reaped on the loop, so its pipes' transports close before the loop does (no zombie, no warning).
        self._reaping = {f for f in self._reaping if not f.done()}
        self._reaping.add(asyncio.ensure_future(worker.proc.wait()))

    async def start(self) -> None:
        """Start every worker now (the function scorer does at service start: an import slower than
        reward.timeout_s would otherwise cost the first items). Raises WorkerFailed when one cannot start;
        its slot then starts a fresh one at the next call."""
        idle = self._queue()
        taken = [idle.get_nowait() for _ in range(idle.qsize())]
        fresh = await asyncio.gather(*(self._spawn() for w in taken if w is None), return_exceptions=True)
        for worker in [w for w in taken if w is not None] + list(fresh):
            idle.put_nowait(worker if isinstance(worker, _Worker) else None)
        errors = [e for e in fresh if isinstance(e, BaseException)]
        if errors:
            raise WorkerFailed(str(errors[0])) from errors[0]

    def _settle(self, idle: asyncio.Queue, spawning: asyncio.Future) -> None:
        """A spawn whose caller was cancelled: its worker (or an empty slot) goes back to the queue."""
        ok = not spawning.cancelled() and spawning.exception() is None
        idle.put_nowait(spawning.result() if ok else None)

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """`request` answered by one worker. Cancelled (the caller's timeout) -> that worker is killed."""
        idle = self._queue()
        worker = await idle.get()
        if worker is None:
            # Shielded: a caller's timeout does not kill a worker that is still importing, or a slow import
            # (torch in a user's file) would be restarted at every item and never be ready.
            spawning = asyncio.ensure_future(self._spawn())
            try:
                worker = await asyncio.shield(spawning)
            except asyncio.CancelledError:
                spawning.add_done_callback(lambda done: self._settle(idle, done))
                raise
            except BaseException:
                idle.put_nowait(None)
                raise
        try:
            worker.proc.stdin.write(json.dumps(request).encode() + b"\n")
            await worker.proc.stdin.drain()
            line = await worker.proc.stdout.readline()
            if not line:
                code = await worker.proc.wait()
                _say_died(self.what, worker.proc.pid, code)
                raise WorkerFailed(f"{self.what} worker pid {worker.proc.pid} died while scoring (exit {code})")
            reply = json.loads(line)
        except BaseException:
            # Cancelled mid-call, died, or said something that is no reply: its state is unknown, so it goes
            # and the slot starts a fresh one next time.
            self._drop(worker)
            idle.put_nowait(None)
            raise
        idle.put_nowait(worker)
        return reply

    async def close(self) -> None:
        """Kill every worker and wait (bounded) until they are reaped."""
        for worker in list(self._all):
            self._drop(worker, replaced=False)
        if self._reaping:
            await asyncio.wait(self._reaping, timeout=5.0)


def _say_died(what: str, pid: int, code: int | None) -> None:
    """Event `reward_worker_died` in the job's run directory (the service's RLSLURM_RUN_DIR), so `rlslurm diag`
    can tell; nothing off a job (`rlslurm score`). Best effort: a death is already the call's WorkerFailed."""
    from rlslurm import events
    from rlslurm.rundir import ENV_VAR, RunDir

    if os.environ.get(ENV_VAR):
        try:
            events.emit(RunDir.from_env(), events.REWARD_WORKER_DIED, role="reward", rank=0, what=what,
                        worker_pid=pid, exit_code=code)
        except OSError as e:
            print(f"reward_worker_died not written: {e}", file=sys.stderr)


def serve_lines(load: Callable[[], Callable[[dict], dict]], on_error: Callable[[Exception], dict]) -> None:
    """The worker's side of the wire (reward/worker.py, tools/worker.py): bind to the parent, move print() off
    stdout, `load()` the code (its failure is the one {"error"} line), say ready, then one reply line per request
    line until stdin closes. A request the handler raises on, or whose reply JSON cannot carry, is answered with
    `on_error(exc)` and the worker keeps serving."""
    lifetime.bind_to_parent(signal.SIGKILL)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the user's print() goes to the service's log, never into a reply
    sys.stdout = sys.stderr
    try:
        handle = load()
    except BaseException as e:  # SystemExit at import too: the pool is told why, never left waiting
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:1000]}) + "\n")
        return
    replies.write(json.dumps({"ready": True, "pid": os.getpid(), "started": time.time()}) + "\n")
    for line in sys.stdin:
        try:
            text = json.dumps(handle(json.loads(line)), default=str)
        except Exception as e:  # a malformed request, a reply JSON cannot carry: answer, keep serving
            text = json.dumps(on_error(e))
        replies.write(text + "\n")
