"""Scorers: turn one response into a reward with a reason (a number; None when it cannot be scored).

    scorer = make_scorer(cfg.reward)                   # rule | code | function | model | judge
    scored = await scorer.score(Item(id="0", prompt="12+7=", response="19", reference="19"))
    verdict = await score_bounded(scorer, item, cfg.reward.timeout_s)   # the service's rules: never raises
    await close_scorer(scorer)                         # its sandbox, its worker processes

rule   the final answer against the reference. Two plain numbers (the answer from \\boxed{..}, "answer is
       ..", "#### ..", else the last number) are compared here as exact fractions ("1,000" == "1000.0"):
       microseconds, and exactly the embedded arithmetic task's own rule. Anything else (LaTeX, \\frac,
       \\pi, units, GSM8K's "#### n" reference) goes to Hugging Face's math-verify in a worker process
       (math_answers.py, workers.py). A number of more than MAX_NUMBER_DIGITS digits or an exponent past
       MAX_EXPONENT is compared as text: exact arithmetic on "1e999999999" would hold the CPU for minutes.
code   a program run once in the sandbox: with an entry point (HumanEval's layout) the prompt, the response,
       the tests and `check(entry_point)`; without, the response's code followed by the tests (code_program).
       1.0 when the tests ran to their end (exit 0 and, after them, a token the program never saw: an early
       exit(0) is no pass).
function  a user's verl-style compute_score in a worker process (function.py).
model  POST {endpoint} {"prompt", "response"} -> {"score": x} (a reward-model server).
judge  an OpenAI-compatible chat endpoint with the rubric as system prompt; its reply must carry
       `SCORE: x`. A reply without one is a parse failure: counted, and the item comes back unscored.

A scorer raises ScorerUnavailable when its upstream (RM, judge) fails: the item is retryable. The types they
share are in items.py, the rule's answer parsing in answers.py and math_answers.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
from dataclasses import dataclass, field

import httpx

from rlslurm.reward.answers import rule_verdict
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import MAX_REASON_CHARS, Item, Scored, Scorer, ScorerUnavailable, Verdict
from rlslurm.reward.math_answers import MATH_TIMEOUT_S, rule_score
from rlslurm.reward.sandbox import Sandbox
from rlslurm.reward.workers import WorkerFailed, WorkerPool

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- rule

@dataclass
class RuleScorer:
    format_regex: str | None = None
    math: WorkerPool | None = None
    """Workers for math-verify (started on the first answer that is not a plain number)."""

    async def score(self, item: Item) -> Scored:
        # Regexes and number parsing are CPU work: in a thread, so the service's event loop (and /health)
        # keep answering; their inputs are bounded (reward.max_item_bytes, MAX_NUMBER_DIGITS, MAX_EXPONENT).
        verdict = await asyncio.to_thread(rule_verdict, item.response, item.reference, self.format_regex)
        if verdict is not None:
            return verdict
        if self.math is None:
            return await asyncio.to_thread(rule_score, item.response, item.reference, self.format_regex)
        try:
            reply = await self.math.call({"response": item.response, "reference": item.reference,
                                          "timeout_s": MATH_TIMEOUT_S})
        except WorkerFailed as e:
            return Scored(None, str(e))
        return Scored(reply["score"], reply["reason"])

    async def close(self) -> None:
        if self.math is not None:
            await self.math.close()


# ---------------------------------------------------------------- code

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The first fenced code block of a response, else the whole response."""
    found = _FENCE.search(response)
    return found.group(1) if found else response


def code_program(item: Item) -> str:
    """The program the code scorer runs for `item`. HumanEval's layout (an entry point): the prompt (the
    function's signature and docstring; in a chat row, the prompt's own fenced block) with the response as
    its completion, then the tests and `check(entry_point)`. A response whose fenced code block itself
    defines the entry point is taken alone instead (a chat model's answer restates the whole function),
    after the prompt's import lines, which such an answer tends to leave out (`from typing import List`).
    Without an entry point: the response's first code block (else all of it), then the tests."""
    if not item.entry_point:
        return extract_code(item.response) + "\n\n" + item.tests + "\n"
    stub = extract_code(item.prompt)
    found = _FENCE.search(item.response)
    defines = found and re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(item.entry_point)}\s*\(", found.group(1), re.M)
    if defines:
        imports = "".join(line + "\n" for line in stub.splitlines() if IMPORT_LINE.match(line))
        solution = imports + found.group(1)
    else:
        solution = stub + item.response
    return f"{solution}\n{item.tests}\ncheck({item.entry_point})\n"


IMPORT_LINE = re.compile(r"(?:from\s+[\w.]+\s+)?import\s")
"""A module-level import line: what a restated function leaves out and the code scorer puts back."""


@dataclass
class CodeScorer:
    sandbox: Sandbox
    outcomes: dict[str, int] = field(default_factory=dict)
    """Executions by sandbox status, for /metrics."""

    async def score(self, item: Item) -> Scored:
        # Exit 0 alone is no proof: a program that calls os._exit(0) (or sys.exit(0)) before the tests run
        # would pass. The tests pass only when the runner, after the tests, prints a token that never
        # appears in the program's text (it comes on stdin and lives in the runner's frame).
        token = secrets.token_hex(16)
        source = code_program(item)
        result = await self.sandbox.execute(_CODE_RUNNER, stdin=f"{token}\n{source}".encode())
        self.outcomes[result.status] = self.outcomes.get(result.status, 0) + 1
        if result.passed and result.stdout.rstrip().endswith(token.encode()):
            return Scored(1.0, "tests passed")
        if result.passed:
            return Scored(0.0, "exited before the tests finished (exit 0 without the runner's token)")
        return Scored(0.0, f"{result.status}: {result.reason}")


_CODE_RUNNER = """\
import sys


def _run():
    token = sys.stdin.readline().strip()
    source = sys.stdin.read()
    exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    sys.stdout.flush()
    sys.stdout.write("\\n" + token + "\\n")


_run()
"""
"""The program the sandbox runs for the code scorer: the response and its tests come on stdin after a
one-line token, and the token is printed only once they returned."""


# ---------------------------------------------------------------- model and judge


class ShardedHttp:
    """Async HTTP POSTs over several small httpx pools, round robin.

    httpcore's pool scans every connection for every request it places (measured: 6 ms of CPU per
    request at 64 connections, 3 s for a 512-response step); pools of <= 8 connections keep that
    scan short while the shards together still hold `connections` requests in flight.
    """

    def __init__(self, connections: int, timeout_s: float, per_shard: int = 8, headers: dict[str, str] | None = None):
        shards = max(1, -(-connections // per_shard))
        size = -(-connections // shards)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        self.shards = [httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) for _ in range(shards)]
        self._next = 0

    async def post(self, url: str, **kw) -> httpx.Response:
        shard = self.shards[self._next]
        self._next = (self._next + 1) % len(self.shards)
        return await shard.post(url, **kw)

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.aclose()


@dataclass
class ModelScorer:
    endpoint: str
    http: ShardedHttp

    async def score(self, item: Item) -> Scored:
        try:
            reply = await self.http.post(self.endpoint, json={"prompt": item.prompt, "response": item.response})
            reply.raise_for_status()
            value = float(reply.json()["score"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise ScorerUnavailable(f"reward model {self.endpoint}: {e!r}") from e
        return Scored(value, "reward model")


_SCORE = re.compile(r"SCORE\s*[:=]\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_judge_reply(text: str, max_score: float) -> float | None:
    """The judge's mark scaled to [0, 1]; None when the reply carries no mark in range."""
    found = _SCORE.findall(text)
    if not found:
        return None
    mark = float(found[-1])
    return mark / max_score if 0 <= mark <= max_score else None


@dataclass
class JudgeScorer:
    endpoint: str
    http: ShardedHttp
    model: str
    rubric: str
    max_score: float
    parse_failures: int = 0

    async def score(self, item: Item) -> Scored:
        question = (f"Question:\n{item.prompt}\n\nReference answer:\n{item.reference}\n\n"
                    f"Answer to grade:\n{item.response}")
        body = {"model": self.model, "temperature": 0.0,
                "messages": [{"role": "system", "content": self.rubric}, {"role": "user", "content": question}]}
        url = self.endpoint.rstrip("/") + "/chat/completions"
        try:
            reply = await self.http.post(url, json=body)
            reply.raise_for_status()
            text = reply.json()["choices"][0]["message"]["content"] or ""
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            raise ScorerUnavailable(f"judge {url}: {e!r}") from e
        value = parse_judge_reply(text, self.max_score)
        if value is None:
            self.parse_failures += 1
            return Scored(None, f"judge parse failure: no SCORE in [0, {self.max_score:g}] in {text[:120]!r}")
        return Scored(value, "judge")


async def score_bounded(scorer: Scorer, item: Item, timeout_s: float) -> Verdict:
    """`scorer` on `item` within `timeout_s` whatever the scorer (a hung judge, a user's function: its worker
    is killed on the cancel), never raising: the reward service's rules, for the service and the inline path."""
    try:
        scored = await asyncio.wait_for(scorer.score(item), timeout_s)
    except asyncio.TimeoutError:
        return Verdict(None, "error", f"scoring ran past reward.timeout_s = {timeout_s:g} s")
    except ScorerUnavailable as e:
        return Verdict(None, "error", str(e)[:MAX_REASON_CHARS])
    except Exception as e:  # one bad item must not take the batch (or the service) down
        log.exception("scoring item %s failed", item.id)
        return Verdict(None, "error", f"scorer crashed: {e!r}"[:MAX_REASON_CHARS])
    return Verdict(scored.score, "scored" if scored.score is not None else "unscored", scored.reason[:MAX_REASON_CHARS])


async def close_scorer(scorer: Scorer) -> None:
    """Stop what a scorer started: the code scorer's sandbox, the rule and function scorers' worker processes."""
    sandbox = getattr(scorer, "sandbox", None)
    if sandbox is not None:
        sandbox.close()
    close = getattr(scorer, "close", None)
    if close is not None:
        await close()


def make_scorer(cfg: RewardConfig, http: ShardedHttp | None = None, sandbox: Sandbox | None = None) -> Scorer:
    """The scorer `cfg.scorer` names; HTTP scorers share `http`, the code scorer uses `sandbox`; the rule and
    function scorers' worker processes number min(concurrency, cores) (CPU-bound Python)."""
    workers = min(cfg.concurrency, os.cpu_count() or 1)
    if cfg.scorer == "rule":
        return RuleScorer(cfg.format_regex, WorkerPool(["--math"], workers, "math-verify"))
    if cfg.scorer == "function":
        from rlslurm.reward.function import FunctionScorer

        return FunctionScorer.start(cfg.function, workers)
    if cfg.scorer == "code":
        # More programs than cores would turn CPU-bound tests into wall timeouts: slots <= cores.
        return CodeScorer(sandbox or Sandbox(cfg.sandbox, slots=workers))
    http = http or ShardedHttp(cfg.concurrency, cfg.timeout_s)
    if cfg.scorer == "model":
        return ModelScorer(cfg.endpoint, http)
    return JudgeScorer(cfg.endpoint, http, cfg.judge_model, cfg.judge_rubric, cfg.judge_max_score)
