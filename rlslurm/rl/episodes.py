"""Multi-turn episodes with tools (rollout.max_turns > 1, rollout.tools): the model turn, the tool calls it made,
their results, the next model turn, until it answers, reaches max_turns or the token budget.

    episodes = Episodes.start(job, tokenizer, model_dir, run)        # the controller's, when rollout.episodes
    out = episodes.complete(client, samples, n=k, max_tokens=..., temperature=1.0, seed=s)
    out["choices"][0]   # text (the final answer), token_ids, token_logprobs, loss_mask, policy_version, messages, ...
    stats = episode_stats(out["choices"])                             # the step's turn and tool metrics
    episodes.close()

`complete` answers in the shape of an engine client's `completions` (rlslurm/rollout/client.py): n choices per
sample, prompt-major, each stamped with the policy version, so the controller's rollout, failover and reward
streaming take episodes as they take single responses.

Tokens, never re-tokenised text: an episode is token ids from the start. Its prompt is encoded once (the chat
template with the tools' schemas, rlslurm/data/turns.py); each turn sends the engine the ids so far (both
engines take token-id prompts) and appends the ids the engine generated as they came; a tool result is
appended as the ids of the template's pieces (rlslurm/data/turns.py TurnTemplate.between_turns). A generated
token's log-probability is the engine's, kept per token; a non-model token has loss_mask 0 and log-prob 0.0,
and the trainer's loss skips it (rlslurm/rl/objective.py pack). Reading a turn's calls decodes its text, for the
parser only: the ids kept are the engine's.

One episode, one version: every turn of an episode is asked of one engine, and an answer stamped with another
policy version than the episode's first turn (a sync landed between two turns) makes the whole call start
again, from the prompts, on the weights served now: an episode is never made of two policies' tokens. A call
that fails (the engine died, was drained, timed out) raises as a single request would: the controller's
failover then draws those samples' episodes again, from the start, elsewhere (never half-counted).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from rlslurm import events
from rlslurm.data.sample import Sample
from rlslurm.data.turns import TurnTemplate
from rlslurm.errors import RlslurmError
from rlslurm.tools.calls import Call, Turn, call_format
from rlslurm.tools.toolbox import ERROR_KINDS, Result, Toolbox

log = logging.getLogger(__name__)

RESTARTS = 3
"""Times a call of episodes starts again because the engine's version changed between two turns."""


@dataclass
class Episode:
    """One episode so far: the ids after the prompt (the model's and the template's), the mask of the model's,
    its log-probs, its messages, and its counts."""

    prompt_ids: list[int]
    messages: list[dict]
    offered: list[str] | None
    context: dict
    budget: int
    """Tokens after the prompt it may hold (rollout.max_episode_tokens, or the context less the prompt)."""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    answer: str = ""
    turns: int = 0
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tool_s: float = 0.0
    cut: str | None = None
    """None (answered), "max_turns" (still calling tools at the last turn) or "tokens" (out of its budget)."""
    finish_reason: str = "stop"
    done: bool = False
    pending: Turn | None = None
    """The last model turn, read (its answer and calls), until the tools have run."""

    def room(self, max_tokens: int) -> int:
        return min(max_tokens, self.budget - len(self.ids))

    def choice(self, version: int) -> dict:
        return {"text": self.answer, "token_ids": list(self.ids), "token_logprobs": list(self.logprobs),
                "loss_mask": list(self.mask), "episode_prompt_ids": list(self.prompt_ids), "policy_version": version,
                "finish_reason": self.finish_reason, "messages": self.messages, "turns": self.turns,
                "tool_calls": self.calls, "tool_errors": sum(self.errors.values()), "tool_error_kinds": self.errors,
                "tool_s": self.tool_s, "cut": self.cut, "generated_tokens": sum(self.mask)}


class Episodes:
    """The job's episodes: its tool box, the call format its model writes, the chat template's pieces."""

    def __init__(self, job, tokenizer, toolbox: Toolbox, *, context_tokens: int, run=None):
        self.job, self.tokenizer, self.toolbox, self.run = job, tokenizer, toolbox, run
        self.max_turns = job.rollout.max_turns
        self.context_tokens = context_tokens
        self.format = call_format(job.rollout.tool_format, tokenizer,
                                  [(name, toolbox.first_parameter(name)) for name in toolbox.names])
        self._templates: dict[str, TurnTemplate] = {}
        self.template(None)  # a template that cannot take tool turns fails the start, not the first step

    @classmethod
    def start(cls, job, tokenizer, model_dir: Path, run) -> "Episodes":
        from rlslurm.rollout.engine import model_facts

        toolbox = Toolbox.start(job.rollout, job.reward.sandbox, log_path=run.logs / "tools.log")
        try:
            return cls(job, tokenizer, toolbox, context_tokens=model_facts(model_dir)[1] or job.model.max_positions,
                       run=run)
        except BaseException:
            toolbox.close()
            raise

    def close(self) -> None:
        self.toolbox.close()

    def template(self, schemas: list[dict] | None) -> TurnTemplate:
        """The template pieces with these tool schemas shown (None: every tool of rollout.tools)."""
        schemas = self.toolbox.schemas if schemas is None else schemas
        key = json.dumps(schemas, sort_keys=True, default=str)
        if key not in self._templates:
            self._templates[key] = TurnTemplate(self.tokenizer, schemas)
        return self._templates[key]

    def _episode(self, sample: Sample) -> Episode:
        extra = sample.extra or {}
        row_tools = extra.get("tools")  # TRL's tools column: the schemas this row shows (and the tools it may call)
        offered = [t["function"]["name"] for t in row_tools] if row_tools else None
        info = extra.get("extra_info") if isinstance(extra.get("extra_info"), dict) else {}
        context = info.get("tools_kwargs") or extra.get("tools_kwargs") or {}  # verl's per-row tool arguments
        prompt_ids = self.template(row_tools or None).prompt_ids(sample.prompt)
        budget = self.job.rollout.max_episode_tokens or self.context_tokens - len(prompt_ids)
        budget = min(budget, self.context_tokens - len(prompt_ids))
        messages = list(sample.prompt) if isinstance(sample.prompt, list) else [
            {"role": "user", "content": sample.prompt}]
        return Episode(prompt_ids, messages, offered, context if isinstance(context, dict) else {}, max(budget, 0))

    def complete(self, client, samples: list[Sample], *, n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
                 seed: int | None = None, timeout_s: float | None = None) -> dict:
        """n episodes per sample on `client`'s engine: {"choices": [...], "policy_version": v} (module docstring)."""
        for _ in range(RESTARTS):
            version, episodes = self._run(client, samples, n, max_tokens, temperature, seed, timeout_s)
            if version is not None:
                choices = []
                for m, ep in enumerate(episodes):
                    choice = ep.choice(version)
                    choice["index"] = m
                    choices.append(choice)
                return {"choices": choices, "policy_version": version}
            log.info("engine %s changed its weights between two turns of an episode: the episodes start again",
                     getattr(client, "url", client))
        raise RlslurmError(f"engine {getattr(client, 'url', client)}: its policy version changed during each of "
                           f"{RESTARTS} tries of one call of episodes (syncs back to back?)")

    def _run(self, client, samples, n, max_tokens, temperature, seed, timeout_s) -> tuple[int | None, list[Episode]]:
        """(the version every turn came from, or None where it changed midway; the episodes)."""
        first = [self._episode(s) for s in samples]
        episodes = [Episode(e.prompt_ids, list(e.messages), e.offered, e.context, e.budget) for e in first
                    for _ in range(n)]
        version = None
        for turn in range(self.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            # One request per distinct room: an episode near its budget asks for fewer tokens, never past the
            # engine's context. The first turn asks for n samples of each prompt, later ones one per episode.
            groups: dict[int, list[int]] = {}
            for m, e in enumerate(episodes):
                if not e.done:
                    room = e.room(max_tokens)
                    if room < 1:
                        e.done, e.cut = True, "tokens"
                        continue
                    groups.setdefault(room, []).append(m)
            for g, (room, members) in enumerate(sorted(groups.items())):
                call_seed = None if seed is None else seed + 7919 * turn + 104_729 * g
                if turn == 0:
                    heads = members[::n]
                    out = client.completions([episodes[m].prompt_ids for m in heads], n=n, max_tokens=room,
                                             temperature=temperature, seed=call_seed, timeout_s=timeout_s)
                else:
                    out = client.completions([episodes[m].prompt_ids + episodes[m].ids for m in members], n=1,
                                             max_tokens=room, temperature=temperature, seed=call_seed,
                                             timeout_s=timeout_s)
                served = int(out["policy_version"])
                if version is None:
                    version = served
                elif served != version:
                    return None, episodes
                for m, c in zip(members, out["choices"]):
                    self._generated(episodes[m], c)
            self._tools(episodes, turn)
        return version, episodes

    def _generated(self, ep: Episode, choice: dict) -> None:
        """A model turn: its ids and log-probs kept as the engine gave them; its text read for calls."""
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("token_logprobs") or [])]
        if len(logprobs) != len(ids):
            raise RlslurmError(f"the engine answered {len(ids)} tokens with {len(logprobs)} log-probabilities")
        ep.ids += ids
        ep.mask += [1] * len(ids)
        ep.logprobs += logprobs
        ep.turns += 1
        ep.finish_reason = choice.get("finish_reason") or "stop"
        ep.pending = self.format.parse(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _tools(self, episodes: list[Episode], turn: int) -> None:
        """After turn `turn`: each live episode answered, or was cut, or has its calls run and their results
        appended (all episodes' calls of this turn at once)."""
        calling: list[Episode] = []
        for ep in episodes:
            if ep.done:
                continue
            parsed = ep.pending
            ep.answer = parsed.answer
            ep.messages.append({"role": "assistant", "content": parsed.answer,
                                **({"tool_calls": [c.as_message() for c in parsed.calls]} if parsed.calls else {})})
            if ep.finish_reason == "length":  # the turn ran out of tokens before its end: nothing more to run
                ep.done, ep.cut = True, "tokens" if parsed.calls or len(ep.ids) >= ep.budget else None
            elif not parsed.calls:
                ep.done = True
            elif turn + 1 >= self.max_turns:
                ep.done, ep.cut = True, "max_turns"
            else:
                calling.append(ep)
        if not calling:
            return
        results = self.toolbox.run_many([(ep.pending.calls, ep.context, ep.offered) for ep in calling])
        for ep, done in zip(calling, results):
            self._results(ep, ep.pending.calls, done)

    def _results(self, ep: Episode, calls: list[Call], results: list[Result]) -> None:
        ep.calls += len(calls)
        ep.tool_s += sum(r.seconds for r in results)
        for r in results:
            if r.error is not None:
                ep.errors[r.error] = ep.errors.get(r.error, 0) + 1
        messages = [self._shown(r) for r in results]
        ids = self.template(None if ep.offered is None else self._offered_schemas(ep.offered)).between_turns(
            messages, ended_with_eos=ep.finish_reason == "stop")
        if len(ep.ids) + len(ids) >= ep.budget:  # no room left for the results and a turn after them
            ep.done, ep.cut = True, "tokens"
            return
        ep.messages.extend(messages)
        ep.ids += ids
        ep.mask += [0] * len(ids)
        ep.logprobs += [0.0] * len(ids)

    def _shown(self, result: Result) -> dict:
        """The tool turn the model reads: the result, or its error in the model's alphabet (the embedded model
        has no letters: `?`)."""
        message = result.message()
        if result.error is not None and self.format.name == "embedded":
            message["content"] = "?"
        return message

    def _offered_schemas(self, offered: list[str]) -> list[dict]:
        return [s for s in self.toolbox.schemas if s["function"]["name"] in offered]


def episode_stats(choices: list[dict]) -> dict:
    """The step's episode metrics over its responses (a single-turn job's: one turn each, no tools), the same
    keys whatever happened (docs/metrics.md)."""
    kinds = {k: 0 for k in ERROR_KINDS}
    for c in choices:
        for k, v in (c.get("tool_error_kinds") or {}).items():
            kinds[k] = kinds.get(k, 0) + v
    n = max(len(choices), 1)
    return {"episode_turns_mean": sum(c.get("turns", 1) for c in choices) / n,
            "tool_calls": sum(c.get("tool_calls", 0) for c in choices),
            "tool_errors": sum(kinds.values()), "tool_error_kinds": kinds,
            "tool_s": sum(c.get("tool_s", 0.0) for c in choices),
            "episodes_cut_max_turns": sum(c.get("cut") == "max_turns" for c in choices),
            "episodes_cut_tokens": sum(c.get("cut") == "tokens" for c in choices)}


def report_tool_errors(run, step: int, stats: dict) -> None:
    """One `tool_errors` event for a step whose tool calls failed (counts per kind): a hostile or confused model
    is visible in the events log, not only in the metrics."""
    if stats["tool_errors"]:
        events.emit(run, events.TOOL_ERRORS, role="controller", step=step, errors=stats["tool_errors"],
                    kinds={k: v for k, v in stats["tool_error_kinds"].items() if v}, calls=stats["tool_calls"])
