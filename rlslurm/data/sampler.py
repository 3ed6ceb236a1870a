"""The seeded order rows are drawn in, and the data position a checkpoint saves.

    sampler = Sampler(n_rows, seed)
    sampler.indices(position, count)        # rows at positions position .. position+count-1
    epoch, index = sampler.split(position)  # what a checkpoint stores; position = epoch * n + index

The stream is epoch after epoch of permutations seeded by (seed, epoch): a pure function of the position,
so a resumed run (one that loads (epoch, index) from its checkpoint) draws the same next rows.
"""

from __future__ import annotations

import torch


class Sampler:
    """Seeded epochs of permutations over `n` rows."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError("a sampler needs at least one row")
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of epoch `epoch` (one epoch cached: a run touches them one at a time)."""
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=generator)
        return self._perm

    def row(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        return int(self.permutation(epoch)[offset])

    def indices(self, position: int, count: int, stride: int = 1) -> list[int]:
        """Rows at positions position, position + stride, ... below position + count."""
        return [self.row(p) for p in range(position, position + count, stride)]

    def split(self, position: int) -> tuple[int, int]:
        """(epoch, index within the epoch) of a position."""
        return divmod(position, self.n)

    def state(self, position: int) -> dict:
        """What a checkpoint saves: the next position as (epoch, index), with the row count and seed it
        belongs to (a resume on other data or another seed is refused, not silently reordered)."""
        epoch, index = self.split(position)
        return {"epoch": epoch, "index": index, "rows": self.n, "seed": self.seed}

    def position(self, state: dict) -> int:
        """The position a saved `state` names; ValueError when it belongs to other data or another seed."""
        if int(state["rows"]) != self.n or int(state["seed"]) != self.seed:
            raise ValueError(f"the checkpoint's data position is for {state['rows']} rows under seed {state['seed']}; "
                             f"this job has {self.n} rows under seed {self.seed}")
        return int(state["epoch"]) * self.n + int(state["index"])
