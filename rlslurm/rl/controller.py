"""The RL controller on trainer rank 0: prompts, rollout, reward, advantages, weight sync, evaluation.

    controller = Controller(job, run, model_dir, tokenizer)
    controller.start_experience(step, version, rl_state)   # rollouts may run ahead (rl.max_staleness)
    exp = controller.experience(step, version, guard)     # prompts -> rollout -> reward -> advantages
    controller.sync_weights(policy.weights(), step=..., version=..., guard=guard)   # DRAIN/UPDATE/VERIFY/RESUME
    controller.close()

It owns the engines (rlslurm/rl/engines.py), the weight-sync protocol and its transport
(rlslurm/sync/), the reward session (rlslurm/reward/session.py: `reward.service` inline, local or
component) and the experience pipeline (rlslurm/rl/pipeline.py). Samples carry the policy version that
produced them.

Prompts are rows of the job's train split (rlslurm/data/splits.py: its data: files, or task:'s generated
arithmetic, one code path), drawn by rlslurm/rl/draw.py's PromptStream; a row's reward item is
rlslurm/reward/items.py's item_for (the arithmetic task keeps its exact rule, so the embedded demo is
unchanged).
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

import torch

from rlslurm import events
from rlslurm.config import JobConfig
from rlslurm.data.layout import RowError
from rlslurm.data.sample import Sample
from rlslurm.data.splits import load_splits
from rlslurm.diag.env_diff import compare, read_fingerprints
from rlslurm.diag.guard import PhaseGuard
from rlslurm.errors import RlslurmError
from rlslurm.layout import JobLayout
from rlslurm.reward.items import item_for
from rlslurm.rl import early
from rlslurm.rl.draw import PromptStream, StepPrompts
from rlslurm.rl.dynamic import Round, drawn_of, fill, merge
from rlslurm.rl.episodes import episode_stats, report_tool_errors
from rlslurm.rl.experience import Advantages, Experience, GroupAssembler, choice_id
from rlslurm.rl.pipeline import THREADED_ENV, ExperiencePipeline, stamp_staleness
from rlslurm.rl.scoring import InlineScorer, open_reward_session, reward_config
from rlslurm.rundir import RunDir
from rlslurm.tasks.arithmetic import parse_prompt
from rlslurm.tasks.prompts import PromptFormat

log = logging.getLogger(__name__)


def sync_host() -> str:
    """Where engines reach the broadcast group's store on this (rank 0) process: its node's address on
    SLURM (engines on the rollout nodes connect to it), loopback elsewhere (engines beside us)."""
    from rlslurm.dist import node_address

    node = os.environ.get("SLURMD_NODENAME")
    return node_address(node) if node else "127.0.0.1"


class Controller:
    """Rank 0: prompts, rollout, reward, advantages, sync, evaluation."""

    def __init__(self, job: JobConfig, run: RunDir, model_dir: Path, tokenizer, *,
                 stopping: Callable[[], bool] = lambda: False):
        from rlslurm.sync.protocol import WeightSync, transport_for

        self.job, self.run, self.tokenizer = job, run, tokenizer
        self.stopping = stopping
        """Whether this rank is draining (SLURM's SIGTERM, a drain request): a lost engine is then not waited for.
        Under a preemption the engines' component is going too, and waiting for a replacement would spend the
        KillWait the drain checkpoint needs (measured: the job killed with no `drained` event)."""
        self.data = job.data.train is not None
        """A user's rows (data.train): scored by reward.scorer; else the task's, by the task's exact rule."""
        # The text an engine is sent for a prompt (task.prompt_style, or a row's text / messages), and the
        # task's rule (task.answer)
        self.format = PromptFormat(job.task, tokenizer, model_dir=model_dir, data=self.data)
        self.train_set, self.held_out = load_splits(job)
        self.stream = PromptStream(self.train_set, per_step=job.rl.prompts_per_step, seed=job.train.seed,
                                   max_bad_share=job.data.max_bad_share)
        self.advantages = Advantages.of(job)  # rl.baseline, rl.overlong
        # Placement, engines and sync method as the plan decided them at submit, never re-derived here.
        self.layout = JobLayout.read(run)
        self.engines = early.take_engines(job, self.layout, run, model_dir)  # started with the rank, where they can
        self.transport = transport_for(self.layout.sync_method, job.sync, weights_dir=run.path / "weights",
                                       host=sync_host())
        self.sync = WeightSync(self.engines.clients, self.transport, job.sync, run=run)
        self.rewards = self.inline = self.episodes = None
        self.pipeline: ExperiencePipeline | None = None  # from the first step on (start_experience)
        self.current_weights = None
        """Rank 0's policy weights now (the loop sets it: Policy.weights): what a lone engine's replacement is
        synced to in the middle of a rollout (`_bring_back`)."""
        try:
            if job.rollout.episodes:  # multi-turn episodes with tools (rlslurm/rl/episodes.py)
                from rlslurm.rl.episodes import Episodes

                self.episodes = Episodes.start(job, tokenizer, model_dir, run)
            self.rewards = open_reward_session(job, self.layout, run)
            if self.rewards is None and self.data:
                self.inline = InlineScorer(reward_config(job))
        except BaseException:
            self.close()  # the engines it spawned must not outlive a controller that never started
            raise

    def close(self) -> None:
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            pipeline.stop()  # first: the engines and the reward service go away below
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if getattr(self, "inline", None) is not None:
            self.inline.close()
        if getattr(self, "episodes", None) is not None:
            self.episodes.close()
        self.transport.close()
        self.engines.stop()
        if pipeline is not None:
            pipeline.close()  # its HTTP call in flight failed just now: it ends

    def check_env(self) -> None:
        """Before the first sync: every rank and engine on one torch (and NCCL) when broadcasting."""
        diff = compare(read_fingerprints(self.run.path), sync_method=self.transport.name)
        if diff.errors or diff.warnings:
            events.emit(self.run, events.ENV_DIFF, report=diff.render(), ok=diff.ok)
        diff.raise_errors()

    def prompts(self, step: int) -> StepPrompts:
        """The step's prompts: a function of (train.seed, the data position, step) alone, so a resumed job
        draws the same ones (rlslurm/rl/draw.py)."""
        return self.stream.draw(step)

    def data_state(self, step: int) -> dict:
        """The data position at boundary `step`, for the RL state of a checkpoint there."""
        return self.stream.state(step)

    def rollout(self, problems: list[Sample], step: int, guard: PhaseGuard,
                on_choices=None, stats: dict | None = None, round_: int = 0) -> tuple[list[dict], list[float]]:
        """k samples per prompt from the engines in rotation, all asked at once (a step's rollout takes the
        slowest engine's time, not their sum); prompts split across engines in a fixed order. `on_choices(batch)`
        gets each engine's responses in this thread as they arrive, so the reward service scores them
        while the other engines still generate. Returns the choices in prompt order and each engine's
        seconds for its share; `stats["prompts_resent"]` counts the prompts of failed requests.

        Failover: a request that fails (refused, reset, timed out, an HTTP error, an answer from a replaced
        engine) takes its engine out of rotation (Engines.take_out) and its prompts go to the engines left,
        with seeds of their own; the step completes with every sample it asked for. No engine left: the
        last error is raised, and the job fails naming that engine (engine_failed), as before. `round_`: the
        step's round of prompts (rl.dynamic_sampling draws more than one), seeded apart."""
        from rlslurm.rollout.client import EngineRequestError

        cfg, k, engines = self.job.rollout, self.job.rl.samples_per_prompt, self.engines
        engines.check_down()

        def ask(i: int, share: list[int], attempt: int) -> tuple[dict, float, float]:
            t = time.monotonic()
            # The first attempt's seed is (seed, step, engine) as before failover existed: runs without a
            # failure sample what they sampled then.
            out = self._complete(engines.clients[i], [problems[j] for j in share], n=k, max_tokens=cfg.max_new_tokens,
                                 temperature=cfg.temperature,
                                 seed=self.job.train.seed * 7919 + step * 31 + i + 1_000_003 * attempt
                                 + 15_485_863 * round_)
            return out, t, time.monotonic()

        choices: list[dict] = []
        engine_s = [0.0] * len(engines.clients)
        resent, first_asked, last_answer = 0, math.inf, -math.inf
        # One thread per engine request: each waits on its HTTP answer.
        with ThreadPoolExecutor(max_workers=max(1, len(engines.clients)), thread_name_prefix="rollout") as pool:
            pending: dict = {}

            def assign(prompts: list[int], attempt: int) -> None:
                live = engines.admitted()  # engine live[p] holds prompts p, p + len(live), ...
                for p, i in enumerate(live):
                    if prompts[p::len(live)]:
                        share = prompts[p::len(live)]
                        pending[pool.submit(ask, i, share, attempt)] = (i, share, attempt)

            assign(list(range(len(problems))), 0)
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for future in done:
                    i, share, attempt = pending.pop(future)
                    try:
                        out, asked, answered = future.result()
                        engines.check_served(i, out)
                    except EngineRequestError as e:
                        engines.take_out(i, e, resent=len(share))
                        if not engines.admitted() and not self._bring_back(step):
                            raise
                        resent += len(share)
                        assign(share, attempt + 1)
                        continue
                    engine_s[i] += answered - asked
                    first_asked, last_answer = min(first_asked, asked), max(last_answer, answered)
                    guard.beat()
                    # index: the sample's place in the step (prompt, then its k samples), so that a response's id
                    # (engine:index, experience.choice_id) stays unique when an engine answers a re-sent share too.
                    batch = [{**c, "engine": i, "prompt_index": share[m // k], "index": share[m // k] * k + m % k}
                             for m, c in enumerate(out["choices"])]
                    if on_choices is not None:
                        on_choices(batch)
                    choices.extend(batch)
        if stats is not None:
            stats["prompts_resent"] = resent
            # From the first request to the last answer: under the sum of the engines' times exactly when their
            # requests overlapped (the rest of rollout_s, scoring beside it and the threads, stays out of it).
            stats["requests_span_s"] = max(last_answer - first_asked, 0.0)
        return sorted(choices, key=lambda c: (c["prompt_index"], c["index"])), engine_s

    def _complete(self, client, samples: list[Sample], **kwargs) -> dict:
        """An engine's answer to `samples`: single responses to their text, or multi-turn episodes with tools."""
        if self.episodes is not None:
            return self.episodes.complete(client, samples, **kwargs)
        return client.completions([self.format.text(s.prompt) for s in samples], **kwargs)

    def _bring_back(self, step: int) -> bool:
        """No engine left in rotation mid-rollout (one engine, the default, killed or hung): while the trainer
        waits, the supervisor's replacement is awaited (rollout.request_timeout_s, Engines.returning), synced
        to the version the others served and VERIFIED, then readmitted (sync_engines: a broadcast group is
        formed anew with it). With the rollout running ahead of training (rl.max_staleness > 0, this is the
        producer thread) the weights of that version are gone: the trainer's next sync, made meanwhile,
        brings the replacement back at its own version (pipeline.await_sync). True once an engine is back;
        False where it cannot be done (no weights; this rank drains: SLURM takes the engines' component too,
        and the drain needs the KillWait)."""
        if not self._can_bring_back():
            return False
        if self.job.rl.max_staleness:
            log.warning("no engine left in rotation in step %d's rollout: waiting for the trainer's next sync to "
                        "bring a replacement back", step)
            # bounded: the trainer's step before that sync (diag.hang_timeout_s) and the replacement's wait
            # there (rollout.request_timeout_s)
            timeout_s = self.job.diag.hang_timeout_s + self.job.rollout.request_timeout_s
            return self.pipeline.await_sync(step, timeout_s) and bool(self.engines.admitted())
        return self._replacement_synced(step)

    def _can_bring_back(self) -> bool:
        """A replacement can be synced: weights to sync it to, a version the engines served, and no drain."""
        return self.current_weights is not None and self.engines.version is not None and not self.stopping()

    def _replacement_synced(self, step: int) -> bool:
        """The trainer's thread, no engine left: the supervisor's replacement awaited (rollout.request_timeout_s,
        Engines.returning), synced to the version the engines served and VERIFIED, readmitted; True once back."""
        version = self.engines.version
        log.warning("no engine left in rotation at step %d: waiting for a replacement, to sync it to version %d",
                    step, version)
        self.engines.check_down()  # every engine down past its budget: the job fails naming them
        if not self.engines.returning():
            return False
        self.sync_engines(self.current_weights(), step=step, version=version)
        return bool(self.engines.admitted())

    def reward_item(self, problems: list[Sample], choice: dict):
        """One response as the reward service scores it: a user's row through item_for (its reference, tests,
        data_source, extra columns); a task prompt as normalised text (task.answer = lenient: the integer it
        states) against the task's answer."""
        from rlslurm.reward.items import Item

        sample = problems[choice["prompt_index"]]
        if self.data:
            return item_for(sample, choice["text"], choice_id(choice), messages=choice.get("messages"))
        return Item(id=choice_id(choice), response=self.format.answer_text(choice["text"]), prompt=sample.prompt,
                    reference=sample.reference)

    def score_inline(self, problems: list[Sample], batch: list[dict]) -> dict[str, float | None]:
        """reward.service = inline: a user's rows by the configured scorer in this process, task prompts by
        the task's exact rule."""
        if self.data:
            return self.inline.score([self.reward_item(problems, c) for c in batch])
        return {choice_id(c): self.format.score(parse_prompt(problems[c["prompt_index"]].prompt), c["text"])
                for c in batch}

    # -- one step's experience: made here (synchronous) or ahead by the pipeline (rlslurm/rl/pipeline.py) --

    def start_experience(self, step: int, version: int, rl_state: dict) -> None:
        """The experience pipeline from `step` on (trainer at `version`, engines serving it), with what a
        checkpoint buffered ahead; a buffered step older than rl.max_staleness allows now is made again."""
        k = self.job.rl.max_staleness
        buffered = {}
        for entry in rl_state.get("experience_buffer", []):
            held = entry["experience"]  # JSON from a checkpoint, or this process's own objects
            m, exp = int(entry["step"]), held if isinstance(held, Experience) else Experience.from_json(held)
            if m >= step and max((version + m - step - v for v in exp.response_versions), default=0) <= k:
                buffered[m] = exp
                self.stream.restored(m, exp.stats.get("data_bad_rows", 0), exp.stats.get("data_rows_drawn"))
        self.pipeline = ExperiencePipeline(self._rollout_step, self._finish_step, max_staleness=k,
                                           first_step=step, last_step=self.job.train.steps, buffered=buffered,
                                           threaded=os.environ.get(THREADED_ENV) == "1" or None).start()
        if self.pipeline.restored:
            events.emit(self.run, events.EXPERIENCE_RESTORED, role="controller", steps=self.pipeline.restored)

    def experience(self, step: int, version: int, guard: PhaseGuard) -> Experience:
        """The experience step `step` trains on at `version`, each sample stamped with its staleness; raises
        StalenessError for one more than rl.max_staleness versions old (a broken schedule)."""
        if getattr(self, "pipeline", None) is None:
            self.start_experience(step, version, {})
        exp = self.pipeline.take(step, guard)
        exp.stats.update(stamp_staleness(exp, version, self.job.rl.max_staleness, step))
        # The step's metrics line says which weights made its responses (each engine's version stamp) and the
        # version the trainer takes them at: what a user checks that no sample came from other weights.
        exp.stats.update(response_versions={str(v): n for v, n in sorted(exp.response_versions.items())},
                         trained_at_version=version)
        return exp

    def sync_weights(self, weights: dict[str, torch.Tensor], *, step: int, version: int, guard: PhaseGuard) -> dict:
        """DRAIN -> UPDATE -> VERIFY -> RESUME to `version` (the policy at step boundary `step`), between two
        rollouts: the ones scheduled on older weights finish first, the ones scheduled on these start
        after (rlslurm/rl/pipeline.py). Returns the sync's metrics."""
        t = time.monotonic()
        self.pipeline.before_sync(step, guard)
        waited_s = time.monotonic() - t
        metrics = self.sync_engines(weights, step=step, version=version)
        self.pipeline.synced(step)
        return {**metrics, "sync_wait_rollout_s": waited_s}

    def sync_engines(self, weights: dict[str, torch.Tensor], *, step: int, version: int) -> dict:
        """One sync over the engines in rotation and the replaced ones that serve again: a replacement is
        readmitted only once this sync's VERIFY passed on it. An engine that fails a stage (died, hung and
        killed by its supervisor) is taken out and the sync made again over the rest; the last engine's
        failure fails the job as before."""
        from rlslurm.sync.protocol import SyncStageError

        self.engines.check_down()
        back = self.engines.returning()
        members = sorted(self.engines.admitted() + back)
        if not members:  # none in rotation and none back within rollout.request_timeout_s
            self.engines.check_down()
            raise RlslurmError(f"no engine to sync to version {version} at step {step}: every engine is out of "
                               f"rotation and none came back within rollout.request_timeout_s = "
                               f"{self.job.rollout.request_timeout_s:g} s (events engine_out, engine_restarted)")
        if back:
            # A replacement listens at its predecessor's URL but is a new peer: a broadcast group is formed
            # again (a new generation) rather than reused.
            self.transport.close()
        while True:
            try:
                report = self.sync.sync(weights, version=version, step=step,
                                        engines=[self.engines.clients[i] for i in members])
                break
            except SyncStageError as e:
                cause = self.engines.culprit(e)
                urls = [self.engines.clients[i].url for i in members]
                if cause is not None and cause.url in urls:
                    i = members.pop(urls.index(cause.url))
                else:
                    # No request named an engine: a collective failed on the trainer's side first (a peer of the
                    # broadcast died, or the stage ran past sync.timeout_s). The member that no longer answers is
                    # the one lost (seen in CI: an engine killed past its budget as a sync took it back).
                    i = self.engines.unanswering(members)
                    if i is None:
                        raise
                    members.remove(i)
                    cause = e
                self.engines.take_out(i, cause, resent=0)
                self.transport.close()
                if not members:
                    # The last engine lost in the sync (the lone engine, the default): its supervisor's
                    # replacement is awaited (bounded: rollout.request_timeout_s) and the sync made again with
                    # it; none back, or past its restart budget (check_down), the job fails as before. Not while
                    # draining: the sync's failure goes to the drain as before.
                    if self.stopping():
                        raise
                    log.warning("the last engine failed the sync to version %d: waiting for its replacement",
                                version)
                    self.engines.check_down()
                    members = self.engines.returning()
                    if not members:
                        raise
                    back = sorted(set(back) | set(members))
        self.engines.version = version
        self.engines.readmit([i for i in back if i in members], version, step)
        return report.metrics()

    def experience_buffer(self, step: int, guard: PhaseGuard) -> list[dict]:
        """The experience made ahead of step boundary `step` (rl.max_staleness > 0), for the RL state of a
        checkpoint there: the resumed run trains on it as the uninterrupted run would have. The Experience
        objects themselves: a checkpoint writes them as JSON (rl/checkpointing.py), once a save, where turning
        them into JSON at every boundary took 6 % of the demo's trainer rank 0 (issue 36)."""
        return [{"step": m, "experience": exp} for m, exp in self.pipeline.buffered(step, guard).items()]

    @staticmethod
    def forget_experience(step: int, rl_state: dict) -> None:
        """Step `step` was abandoned (SLURM stops the job): keep it out of the drain checkpoint's buffer, so
        the resumed job makes it again rather than train on what the stopping services returned."""
        if "experience_buffer" in rl_state:
            rl_state["experience_buffer"] = [e for e in rl_state["experience_buffer"] if e["step"] != step]

    def _rollout_step(self, step: int, guard) -> dict:
        """Step `step`'s prompts through the engines: one round, or with rl.dynamic_sampling rounds until the
        step is full (rlslurm/rl/dynamic.py). `_finish_step` waits for the rewards still open."""
        t, rl = time.monotonic(), self.job.rl
        with guard.phase("data", step=step):
            drawn = self.prompts(step)
        rounds = [self._round(step, drawn, 0, guard)]
        if rl.dynamic_sampling:
            def next_round(index: int, count: int) -> Round:
                with guard.phase("data", step=step):
                    more = self.stream.draw_more(step, count)
                return self._round(step, more, index, guard)

            rounds = fill(rounds[0], per_step=rl.prompts_per_step, max_rounds=rl.dynamic_sampling_max_rounds,
                          next_round=next_round, guard=guard)
        return {"step": step, "rounds": rounds, "rollout_s": time.monotonic() - t}

    def _round(self, step: int, drawn: StepPrompts, index: int, guard) -> Round:
        """One round's prompts through the engines. Each engine's responses are scored as they arrive (the
        rule right here, or the service's requests meanwhile) and a prompt's group gets its advantages as
        soon as its last reward lands (GroupAssembler)."""
        problems = drawn.samples
        assembler = GroupAssembler(problems, self.job.rl.samples_per_prompt, self.format.encode, self.advantages)
        scoring = self.rewards.begin(step) if self.rewards is not None else None

        def arrived(batch: list[dict]) -> None:
            assembler.add_choices(batch)
            if scoring is None:
                assembler.add_rewards(self.score_inline(problems, batch))
            else:
                scoring.submit([self.reward_item(problems, c) for c in batch],
                               on_outcomes=lambda outcomes: assembler.add_rewards({o.id: o.score for o in outcomes}))

        failover: dict = {}
        with guard.phase("rollout", step=step):
            choices, engine_s = self.rollout(problems, step, guard, on_choices=arrived, stats=failover, round_=index)
        return Round(drawn, assembler, scoring, choices, engine_s, failover.get("prompts_resent", 0),
                     span_s=failover.get("requests_span_s", 0.0))

    def _finish_step(self, flight: dict, guard) -> Experience:
        """The rest of a step: the rewards the rollout did not hide, the last groups' advantages, stats."""
        step, rounds, rl = flight["step"], flight["rounds"], self.job.rl
        t = time.monotonic()
        with guard.phase("reward", step=step):
            for r in rounds:
                r.finish(guard)
        reward_s = time.monotonic() - t
        with guard.phase("advantage", step=step):
            samples, versions, merged = merge(rounds, per_step=rl.prompts_per_step, dynamic=rl.dynamic_sampling)
        drawn = drawn_of(rounds)
        episodes = episode_stats([c for r in rounds for c in r.choices])
        report_tool_errors(self.run, step, episodes)
        stats = {"rollout_s": flight["rollout_s"], "reward_s": reward_s, **merged,
                 "tokens_per_s": merged["generated_tokens"] / max(flight["rollout_s"], 1e-9),
                 **self.engines.metrics(), **episodes, **self._data_stats(step, drawn)}
        return Experience(samples, stats, versions)

    def _data_stats(self, step: int, drawn: StepPrompts) -> dict:
        """Where the step's prompts came from: its first data position, their rows, the bad rows skipped."""
        epoch, index = self.stream.sampler.split(drawn.position)
        if drawn.bad:
            events.emit(self.run, events.DATA_ROWS_SKIPPED, role="controller", step=step, too_long=0, truncated=0,
                        bad_rows=drawn.bad, first_reason=drawn.first_reason)
        return {"data_epoch": epoch, "data_index": index, "data_rows": drawn.rows, "data_bad_rows": drawn.bad}

    def evaluate(self, step: int) -> dict:
        """Greedy decoding of the first rl.eval_rows held-out rows by the policy the engines serve now, scored
        by the task's exact rule or, for a user's rows, by the configured reward: {held_out_accuracy (the pass
        rate), eval_reward_mean, eval_pass_rate (full marks: reward >= 1), eval_rows}. Asked of the first engine
        in rotation; one that fails is taken out and the next one asked. None left (a lone engine lost): its
        replacement is awaited and synced to the served version as mid-rollout; only where that cannot be done
        does the error fail the job. This is the trainer's thread at a step boundary, where the engines serve
        the trainer's own version, so the replacement is synced here whatever rl.max_staleness is."""
        from rlslurm.rollout.client import EngineRequestError

        rows = [self.held_out.try_sample(i) for i in range(min(len(self.held_out), self.job.rl.eval_rows))]
        samples = [s for s in rows if not isinstance(s, RowError)]  # validate names them; evaluation skips them
        while True:
            i = self.engines.admitted()[0]
            try:
                out = self._complete(self.engines.clients[i], samples, n=1, temperature=0.0,
                                     max_tokens=self.job.rollout.max_new_tokens)
                self.engines.check_served(i, out)
                break
            except EngineRequestError as e:
                self.engines.take_out(i, e, resent=len(samples))
                if self.engines.admitted():
                    continue
                if not (self._can_bring_back() and self._replacement_synced(step)):
                    raise
        texts = [c["text"] for c in out["choices"]]
        if self.data:
            items = [item_for(s, t, f"eval:{n}") for n, (s, t) in enumerate(zip(samples, texts))]
            if self.inline is not None:
                scored = self.inline.score(items)
                scores = [scored[item.id] for item in items]
            else:
                scoring = self.rewards.begin(step)
                scoring.submit(items)
                scores = [o.score for o in scoring.finish()[0]]
        else:
            scores = [self.format.score(parse_prompt(s.prompt), t) for s, t in zip(samples, texts)]
        kept = [x for x in scores if x is not None] or [0.0]
        passed = sum(x is not None and x >= 1.0 for x in scores) / max(len(scores), 1)
        return {"held_out_accuracy": passed, "eval_reward_mean": sum(kept) / len(kept), "eval_pass_rate": passed,
                "eval_rows": len(samples)}
