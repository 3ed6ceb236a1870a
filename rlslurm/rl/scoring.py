"""How the RL job's rewards are scored: the reward service's session (`open_reward_session`, with the config it
scores by and its environment), or, with reward.service = inline for a user's rows, the reward service's own
scorer (rlslurm/reward/scorers.py `make_scorer`: rule, code, function, ...) run in the controller's process, so an
inline run scores a row exactly as the service would.

    scorer = InlineScorer(reward_cfg)
    scores = scorer.score([item_for(sample, text, id), ...])     # {id: reward, or None (dropped)}
    scorer.close()

The arithmetic task keeps its own exact rule inline (rlslurm/tasks/prompts.py PromptFormat.score): the
embedded demo trains as it always did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

from rlslurm.config import JobConfig
from rlslurm.errors import RewardServiceError
from rlslurm.layout import JobLayout
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.items import Item
from rlslurm.reward.scorers import close_scorer, make_scorer, score_bounded
from rlslurm.rundir import RunDir
from rlslurm.tasks.arithmetic import ANSWER_FORMAT

log = logging.getLogger(__name__)


class InlineScorer:
    """make_scorer(cfg) on an event loop of this object's own. Lifecycle: made with the controller, used by
    the rollout (possibly the pipeline's thread) and the evaluation (the main thread) one at a time, closed
    with the controller."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.scorer = make_scorer(cfg)
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()

    def score(self, items: list[Item]) -> dict[str, float | None]:
        """Every item's reward within reward.timeout_s (score_bounded: the service's own rules, a hung user
        function's worker killed); one the scorer could not score is degraded as reward.degrade says."""
        async def every():
            return await asyncio.gather(*(score_bounded(self.scorer, item, self.cfg.timeout_s) for item in items))

        with self._lock:
            verdicts = self.loop.run_until_complete(every())
        scores: dict[str, float | None] = {}
        for item, verdict in zip(items, verdicts):
            if verdict.status == "scored":
                scores[item.id] = verdict.score
                continue
            if self.cfg.degrade == "fail":
                raise RewardServiceError(f"reward.scorer = {self.cfg.scorer!r} could not score response {item.id} "
                                         f"({verdict.status}: {verdict.reason}) and reward.degrade = fail")
            log.warning("response %s %s (degraded: %s): %s", item.id, verdict.status, self.cfg.degrade, verdict.reason)
            scores[item.id] = self.cfg.neutral_score if self.cfg.degrade == "neutral" else None
        return scores

    def close(self) -> None:
        """Stop the scorer's sandbox and worker processes, then the loop."""
        with self._lock:
            try:
                self.loop.run_until_complete(close_scorer(self.scorer))
            finally:
                self.loop.close()


def reward_config(job: JobConfig) -> RewardConfig:
    """job.reward as the service must score this job: for the arithmetic task the rule scorer also checks the
    task's one answer form (ANSWER_FORMAT), unless reward.format_regex names another, so it scores as `score`
    does; a user's rows are scored as configured."""
    if job.reward.scorer == "rule" and job.reward.format_regex is None and job.data.train is None:
        return dataclasses.replace(job.reward, format_regex=ANSWER_FORMAT)
    return job.reward


def open_reward_session(job: JobConfig, layout: JobLayout, run: RunDir):
    """None for reward.service = inline (the controller scores); else the service's session: the reward
    component's (announced in <run>/endpoints/reward.json) on SLURM, else a supervised one started here
    (off SLURM there is no reward component: `component` runs the same service beside the controller)."""
    if job.reward.service == "inline":
        return None
    from rlslurm.reward.session import RewardSession

    return RewardSession.open(reward_config(job), run, diag=job.diag, component=layout.reward_from_component,
                              env=reward_env(job))


def reward_env(job: JobConfig) -> dict[str, str]:
    """What the reward service's launcher adds to its environment: the job's network environment, no GPU."""
    from rlslurm.devices import CVD
    from rlslurm.network import network_env

    return {**network_env(job.network), CVD: ""}
