"""The train and held-out Samples of a job: its `data:` files, or `task:`'s generated arithmetic.

    train, held_out = load_splits(job)      # SampleTables; same on every rank, run and requeue
"""

from __future__ import annotations

import math

from rlslurm.data.config import DataConfig
from rlslurm.data.layout import DataError, Layout, resolve
from rlslurm.data.source import from_rows, open_dataset
from rlslurm.data.table import SampleTable
from rlslurm.tasks.arithmetic import make_splits

TASK_LAYOUT = Layout("columns", prompt="prompt", completion="completion", messages=None, reference="reference",
                     tests=None)
"""The generated arithmetic's rows: {prompt: "12+7=", completion: "19", reference: "19"}."""


def needs(job) -> frozenset[str]:
    """Sample fields every row must have for this job: SFT learns a completion; RL's reward compares with a
    reference (rule, model, judge) or runs the row's tests (code); a reward function also takes a list or
    mapping ground truth as it is (verl's compute_score gets the value; "structured_reference")."""
    if job.job.kind == "sft":
        return frozenset({"completion"})
    if job.job.kind == "rl":
        if job.reward.scorer == "code":
            return frozenset({"tests"})
        return frozenset({"reference", "structured_reference"} if job.reward.scorer == "function" else {"reference"})
    return frozenset()


def task_splits(job) -> tuple[SampleTable, SampleTable]:
    """`task:` (the generated arithmetic) as two SampleTables, row i = make_splits' problem i."""
    train, held_out = make_splits(job.task)

    def table(problems, name):
        rows = [{"prompt": p.prompt, "completion": p.target, "reference": p.target} for p in problems]
        return SampleTable(from_rows(rows), TASK_LAYOUT, f"task ({name}, generated)", needs(job))

    return table(train, "train"), table(held_out, "held-out")


def fraction_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, held-out rows) of `n` rows: ceil(n * fraction) held out (at least 1, at most n - 1),
    chosen by a permutation seeded by `seed`; both in file order."""
    import torch  # here: `rlslurm submit` and `validate` import this module, and need no torch for it

    held = min(n - 1, max(1, math.ceil(n * fraction)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[held:]), sorted(order[:held])


def open_table(data: DataConfig, path: str, key: str, need: frozenset[str]) -> SampleTable:
    ds = open_dataset(path, key)
    source = f"{key} = {path}"
    return SampleTable(ds, resolve(data, list(ds.column_names), source), source, need)


def load_splits(job) -> tuple[SampleTable, SampleTable]:
    """(train, held-out) of the job: data.train with data.eval or data.eval_fraction, else `task:`."""
    data: DataConfig = job.data
    if data.train is None:
        return task_splits(job)
    need = needs(job)
    train = open_table(data, data.train, "data.train", need)
    if data.eval is not None:
        return train, open_table(data, data.eval, "data.eval", need)
    if len(train) < 2:
        raise DataError(f"{train.source}: holds {len(train)} row; data.eval_fraction needs at least 2 "
                        f"(or set data.eval)")
    kept, held = fraction_split(len(train), data.eval_fraction, data.seed)
    return (SampleTable(train.dataset.select(kept), train.layout, train.source, need, tuple(kept)),
            SampleTable(train.dataset.select(held), train.layout, train.source, need, tuple(held)))
