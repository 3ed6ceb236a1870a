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
from rlslurm.reward.scorers import Item, make_scorer

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
        """Every item's reward; one the scorer fails on is degraded as reward.degrade says (as the service's)."""
        async def every():
            return await asyncio.gather(*(self.scorer.score(item) for item in items), return_exceptions=True)

        with self._lock:
            results = self.loop.run_until_complete(every())
        scores: dict[str, float | None] = {}
        for item, got in zip(items, results):
            if isinstance(got, BaseException):
                if self.cfg.degrade == "fail":
                    raise RewardServiceError(f"reward.scorer = {self.cfg.scorer!r} failed on response {item.id} and "
                                             f"reward.degrade = fail: {got!r}") from got
                log.warning("scorer failed on response %s (degraded: %s): %r", item.id, self.cfg.degrade, got)
                scores[item.id] = self.cfg.neutral_score if self.cfg.degrade == "neutral" else None
            else:
                scores[item.id] = got.score
        return scores

    def close(self) -> None:
        with self._lock:
            self.loop.close()
