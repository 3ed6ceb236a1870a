"""The tools of an RL job's episodes (rollout.tools): their schemas, and every call run bounded, its failure a
short message back to the model and a counted error, never an exception in the step.

    box = Toolbox.start(job.rollout, job.reward.sandbox, log_path=run.logs / "tools.log")
    box.schemas                                   # JSON schemas in rollout.tools' order (the chat template's `tools`)
    results = box.run(calls, context={...})       # one Result per Call, in order; never raises for a call
    box.close()

Where each tool runs: `calculator` in this process (rlslurm/tools/builtin.py: bounded, no eval); `python` in the
reward sandbox (rlslurm/reward/sandbox.py: model-written code, no network, its own uids); a user's function in
worker processes (rlslurm/tools/worker.py through rlslurm/reward/workers.py's pool: a call past
rollout.tool_timeout_s kills its worker, the next call gets a fresh one). Calls run concurrently on an event
loop of the tool box's own thread (`rlslurm-tools`), however many rollout threads ask at once.

Error kinds (Result.error; the step's `tool_error_kinds` counts them, docs/agentic.md):
malformed (the call could not be read), unknown_tool, bad_arguments (missing, unknown or mistyped against the
schema, or refused by the function's signature), raised (the tool raised, or its worker died), timeout,
output_limit (a result longer than rollout.tool_output_chars), too_many_calls (more than MAX_CALLS_PER_TURN in
one turn). Nothing a tool returns reaches the trainer but the tokens of its (short) text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from rlslurm.errors import ConfigError
from rlslurm.reward.config import SandboxConfig
from rlslurm.rollout.config import BUILTIN_TOOLS, RolloutConfig
from rlslurm.tools.builtin import BUILTINS, ToolError, calculate, python_output
from rlslurm.tools.calls import MAX_CALLS_PER_TURN, Call
from rlslurm.tools.schema import check_arguments

log = logging.getLogger(__name__)

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "output_limit", "too_many_calls")
SANDBOX_UID_OFFSET = 4096
"""The python tool's sandbox uids start this far above reward.sandbox.uid_base: a code scorer running at the same
time keeps its own per-uid process limits."""
SANDBOX_SLACK_S = 5.0
"""Seconds a python call may take past rollout.tool_timeout_s: the sandbox's kill and reaping of the program."""


@dataclass(frozen=True)
class Result:
    """One call's outcome: the text the model is shown (`content`), its error kind or None, and its seconds."""

    name: str
    content: str
    error: str | None
    seconds: float

    def message(self) -> dict:
        """The tool turn that tells the model."""
        return {"role": "tool", "name": self.name or "?", "content": self.content}


def short(kind: str, detail: str, chars: int = 200) -> str:
    """A tool error as the model reads it: one line, short."""
    text = f"error ({kind}): {' '.join(str(detail).split())}"
    return text if len(text) <= chars else text[:chars - 3] + "..."


class Toolbox:
    """The job's tools and the thread whose event loop runs their calls. Lifecycle: `start` (user tools' workers
    start and describe themselves: their schemas), `run` from any thread, `close` once."""

    def __init__(self, cfg: RolloutConfig, sandbox: SandboxConfig, *, log_path: Path | None = None):
        # The sandbox's own wall clock stops a program at rollout.tool_timeout_s (it kills the whole namespace; a
        # cancelled wait would leave it running).
        self.cfg, self.sandbox_cfg = cfg, dataclasses.replace(sandbox, uid_base=sandbox.uid_base + SANDBOX_UID_OFFSET,
                                                              wall_s=min(sandbox.wall_s, cfg.tool_timeout_s))
        self.names = [spec if spec in BUILTIN_TOOLS else spec.rpartition(":")[2] for spec in cfg.tools]
        self.specs = dict(zip(self.names, cfg.tools))
        self.schemas: list[dict] = []
        self._pools: dict[str, object] = {}
        self._sandbox = None
        self._log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 (closed in close())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlslurm-tools", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, cfg: RolloutConfig, sandbox: SandboxConfig, *, log_path: Path | None = None) -> "Toolbox":
        box = cls(cfg, sandbox, log_path=log_path)
        try:
            box._submit(box._start()).result()
        except BaseException:
            box.close()
            raise
        return box

    def _submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> None:
        from rlslurm.reward.workers import WorkerFailed, WorkerPool

        for i, (name, spec) in enumerate(self.specs.items()):
            if spec in BUILTINS:
                self.schemas.append(BUILTINS[spec])
                if spec == "python":
                    from rlslurm.errors import RewardServiceError
                    from rlslurm.reward.sandbox import Sandbox

                    try:  # made on this loop: its slot queue binds to it
                        self._sandbox = Sandbox(self.sandbox_cfg, slots=self.cfg.tool_workers)
                    except RewardServiceError as e:
                        raise ConfigError(f"rollout.tools[{i}] = python: {e}") from None
                continue
            pool = WorkerPool([str(Path(spec.rpartition(":")[0]).resolve()) + ":" + name,
                               str(self.cfg.tool_output_chars)], self.cfg.tool_workers, f"tool {spec}",
                              module="rlslurm.tools.worker", stderr=self._log)
            self._pools[name] = pool
            try:
                reply = await asyncio.wait_for(pool.call({"describe": True}), 120.0)
            except (WorkerFailed, asyncio.TimeoutError) as e:
                raise ConfigError(f"rollout.tools[{i}] = {spec!r}: the tool could not be loaded: {e}") from None
            schema = reply.get("schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict):
                raise ConfigError(f"rollout.tools[{i}] = {spec!r}: its schema is not {{type, function: {{name, "
                                  f"parameters}}}}: {str(schema)[:200]}")
            schema["function"]["name"] = name
            self.schemas.append(schema)

    def first_parameter(self, name: str) -> str | None:
        """The first parameter of tool `name`'s schema (what the embedded format's `[ARG]` fills)."""
        schema = self.schemas[self.names.index(name)]
        props = list((schema["function"].get("parameters") or {}).get("properties") or {})
        return props[0] if props else None

    def run(self, calls: list[Call], context: dict | None = None, offered: list[str] | None = None) -> list[Result]:
        """Every call of one model turn, concurrently; one Result each, in order. `context`: the row's
        tools_kwargs by tool name (verl), given to a user's tool; `offered`: the tools this row may call (None:
        all of rollout.tools)."""
        if not calls:
            return []
        return self._submit(self._run_all(calls, context or {}, offered)).result()

    def run_many(self, turns: list[tuple[list[Call], dict | None, list[str] | None]]) -> list[list[Result]]:
        """`run` for several episodes' turns at once, all their calls concurrent: [(calls, context, offered)]."""
        async def every():
            return await asyncio.gather(*(self._run_all(c, ctx or {}, o) for c, ctx, o in turns))

        return list(self._submit(every()).result()) if turns else []

    async def _run_all(self, calls: list[Call], context: dict, offered: list[str] | None) -> list[Result]:
        head = calls[:MAX_CALLS_PER_TURN]
        results = list(await asyncio.gather(*(self._run_one(c, context, offered) for c in head)))
        if len(calls) > len(head):
            results.append(Result("", short("too_many_calls", f"{len(calls)} calls in one turn; at most "
                                                              f"{MAX_CALLS_PER_TURN} run"), "too_many_calls", 0.0))
        return results

    async def _run_one(self, call: Call, context: dict, offered: list[str] | None) -> Result:
        started = time.monotonic()

        def done(content: str, error: str | None = None) -> Result:
            return Result(call.name, content, error, time.monotonic() - started)

        if call.error is not None:
            return done(short("malformed", f"{call.error}: {call.text}"), "malformed")
        if call.name not in self.names or (offered is not None and call.name not in offered):
            return done(short("unknown_tool", f"no tool {call.name[:60]!r}; the tools are "
                                              f"{offered if offered is not None else self.names}"), "unknown_tool")
        problem = check_arguments(self.schemas[self.names.index(call.name)], call.arguments)
        if problem is not None:
            return done(short("bad_arguments", f"{call.name}: {problem}"), "bad_arguments")
        # python: the sandbox stops the program itself at the timeout; the slack only bounds its own cleanup.
        timeout_s = self.cfg.tool_timeout_s + (SANDBOX_SLACK_S if self.specs[call.name] == "python" else 0.0)
        try:
            content, error = await asyncio.wait_for(self._execute(call, context.get(call.name) or {}), timeout_s)
        except asyncio.TimeoutError:
            return done(short("timeout", f"{call.name} took more than rollout.tool_timeout_s = "
                                         f"{self.cfg.tool_timeout_s:g} s and was stopped"), "timeout")
        except Exception as e:  # a worker that died, or anything our side did not foresee: the call's failure
            return done(short("raised", f"{call.name}: {type(e).__name__}: {e}"), "raised")
        if error is None and len(content) > self.cfg.tool_output_chars:
            return done(short("output_limit", f"{call.name} returned more than rollout.tool_output_chars = "
                                              f"{self.cfg.tool_output_chars} characters"), "output_limit")
        return done(content if error is None else short(error, content), error)

    async def _execute(self, call: Call, context: dict) -> tuple[str, str | None]:
        spec = self.specs[call.name]
        if spec == "calculator":
            try:
                return calculate(call.arguments["expression"]), None
            except ToolError as e:
                return str(e), "raised"
        if spec == "python":
            result = await self._sandbox.execute(call.arguments["code"])
            return python_output(result.status, result.stdout, result.stderr, result.reason,
                                 cpu_limited=result.status == "signal" and result.signal in ("SIGXCPU", "SIGKILL")
                                 and result.wall_s >= self.sandbox_cfg.cpu_s)
        reply = await self._pools[call.name].call({"arguments": call.arguments, "context": _kwargs(context)})
        if "error" in reply:
            return str(reply.get("message", "")), str(reply["error"]) if reply["error"] in ERROR_KINDS else "raised"
        output = str(reply.get("output", ""))
        if int(reply.get("chars", len(output))) > self.cfg.tool_output_chars:
            return f"{call.name} returned {reply.get('chars')} characters, more than rollout.tool_output_chars = " \
                   f"{self.cfg.tool_output_chars}", "output_limit"
        return output, None

    def close(self) -> None:
        """Stop every worker and the sandbox, then the loop's thread (bounded)."""
        async def stop():
            for pool in self._pools.values():
                await pool.close()

        if self._thread.is_alive():
            try:
                self._submit(stop()).result(timeout=10)
            except Exception as e:  # closing: what is left dies with its parent (workers bind to it)
                log.warning("tool workers did not stop cleanly: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if self._sandbox is not None:
            self._sandbox.close()
        if self._log is not None:
            self._log.close()


def _kwargs(context: dict) -> dict:
    """verl's tools_kwargs entry of one tool ({create_kwargs, execute_kwargs, ...}) as keyword arguments; a plain
    mapping is taken as they are."""
    if not isinstance(context, dict):
        return {}
    if any(k in context for k in ("create_kwargs", "execute_kwargs")):
        return {**(context.get("create_kwargs") or {}), **(context.get("execute_kwargs") or {})}
    return dict(context)
