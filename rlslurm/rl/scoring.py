"""reward.service = inline for a user's rows: the reward service's own scorer (rlslurm/reward/scorers.py
`make_scorer`: rule, code, function, ...) run in the controller's process, so an inline run scores a row
exactly as the service would.

    scorer = InlineScorer(reward_cfg)
    scores = scorer.score([item_for(sample, text, id), ...])     # {id: reward, or None (dropped)}
    scorer.close()

The arithmetic task keeps its own exact rule inline (rlslurm/tasks/prompts.py PromptFormat.score): the
embedded demo trains as it always did.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from rlslurm.errors import RewardServiceError
from rlslurm.reward.config import RewardConfig
from rlslurm.reward.scorers import Item, close_scorer, make_scorer, score_bounded

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
