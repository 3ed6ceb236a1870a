"""Worker processes of the reward service: Python it must not run on its own event loop or threads.

    pool = WorkerPool(["--function", "/abs/rewards.py:compute_score"], size=2, what="reward.function")
    reply = await pool.call({"data_source": "gsm8k", ...})     # {"score": x | None, "reason": "..."}
    await pool.close()

    python -m rlslurm.reward.workers --function FILE.py:NAME    # one worker (the pool starts it)
    python -m rlslurm.reward.workers --math                     # math-verify (rule scorer, math_answers.py)

Why processes: a user's reward function (reward.scorer: function) or a sympy parse (math-verify) can run
forever, and Python cannot stop a thread; one stuck in the service's thread pool would hold it until
every slot is gone and /health stops answering. A worker is killed instead (SIGKILL to its process group)
when its call is cancelled (the service's per-item `reward.timeout_s`) and a fresh one takes its place
at the next call. In a worker the call runs on its main thread, so math-verify's own signal.alarm()
timeouts work there (they refuse to run off the main thread).

Wire: one JSON line per call each way, over the worker's stdin and stdout (local pipes, no pickle);
the worker first answers one line {"ready": true} or {"error": "..."} once its code is imported. It
moves anything the user's code prints to stderr (the service's log), so stdout carries only replies.

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
from typing import Any

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

    def __init__(self, args: list[str], size: int, what: str):
        self.args, self.size, self.what = list(args), size, what
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
            sys.executable, "-m", "rlslurm.reward.workers", *self.args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, start_new_session=True, limit=LINE_LIMIT)
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


# ---------------------------------------------------------------- the worker's side


def _score_of(value: Any, name: str) -> dict[str, Any]:
    """A reward function's return value as {"score", "reason"}: a finite number (bool and int too), or a dict
    holding one under "score" (its other keys go into the reason, as verl logs them); anything else is no
    score, and the reason says what came back."""
    import math
    import numbers

    extra = ""
    if isinstance(value, dict):
        if "score" not in value:
            return {"score": None, "reason": f"{name} returned a dict without 'score' (keys {sorted(value)[:8]})"}
        extra = ", ".join(f"{k}={v!r}" for k, v in value.items() if k != "score")
        value = value["score"]
    # numbers.Real covers bool, int, float and numpy's floats; __float__ numpy's bool_ and a 0-d tensor.
    try:
        if not isinstance(value, numbers.Real) and (isinstance(value, (str, bytes)) or not hasattr(value, "__float__")):
            raise TypeError
        score = float(value)
    except Exception:  # a user's object whose __float__ raises (a tensor of many elements): no number
        return {"score": None, "reason": f"{name} returned {type(value).__name__} {value!r:.80}, not a number"}
    if not math.isfinite(score):
        return {"score": None, "reason": f"{name} returned {score}, not a finite number"}
    return {"score": score, "reason": (f"{name}" + (f": {extra}" if extra else ""))[:REASON_CHARS]}


def _function_handler(spec: str):
    from rlslurm.reward.function import load_function

    fn, name = load_function(spec)

    def handle(request: dict) -> dict:
        # Trusted code: the user's own reward (as in verl), run as the service's uid with no sandbox; model
        # written code never comes here (reward.scorer: code runs it in the sandbox).
        try:
            value = fn(request["data_source"], request["solution_str"], request["ground_truth"],
                       extra_info=request["extra_info"])
        except BaseException as e:  # SystemExit too: one item's failure, never the worker's
            return {"score": None, "reason": f"{name} raised {type(e).__name__}: {e}"[:REASON_CHARS]}
        return _score_of(value, name)

    return handle


def _math_handler():
    from rlslurm.reward.math_answers import verify_scored

    def handle(request: dict) -> dict:
        scored = verify_scored(request["response"], request["reference"], timeout_s=request.get("timeout_s", 5))
        return {"score": scored.score, "reason": scored.reason[:REASON_CHARS]}

    return handle


def serve(argv: list[str]) -> None:
    """One worker: import, say ready, then answer requests until stdin closes."""
    lifetime.bind_to_parent(signal.SIGKILL)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the user's print() goes to the service's log, never into a reply
    sys.stdout = sys.stderr
    try:
        handle = _function_handler(argv[1]) if argv[0] == "--function" else _math_handler()
    except Exception as e:
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:1000]}) + "\n")
        return
    replies.write(json.dumps({"ready": True, "pid": os.getpid(), "started": time.time()}) + "\n")
    for line in sys.stdin:
        try:
            reply = handle(json.loads(line))
        except Exception as e:  # a malformed request: answer, keep serving
            reply = {"score": None, "reason": f"worker error {type(e).__name__}: {e}"[:REASON_CHARS]}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve(sys.argv[1:])
