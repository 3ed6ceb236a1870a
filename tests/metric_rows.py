"""The metrics rows' one-key-set check, for every tier (tests/conftest.py puts this folder on sys.path):

    from metric_rows import assert_one_key_set
    keys = assert_one_key_set(rows)     # the RL step rows of a run: the keys every one of them has

Every RL step's row has the same keys whatever happened in the step (docs/metrics.md, issue 42); a step with a
held-out evaluation adds rlslurm.rl.loop.EVAL_KEYS, and only those.
"""

from __future__ import annotations

from rlslurm.rl.loop import EVAL_KEYS


def assert_one_key_set(rows: list[dict]) -> set[str]:
    """Every row of `rows` has the same keys, an evaluated row EVAL_KEYS more; returns the common set."""
    assert rows, "no rows"
    common = {frozenset(set(r) - set(EVAL_KEYS)) for r in rows}
    odd = set.union(*map(set, common)) - set.intersection(*map(set, common))
    assert len(common) == 1, f"keys some rows have and others lack: {sorted(odd)}"
    (keys,) = common
    extra = [sorted(set(r) - keys) for r in rows if set(r) not in (keys, keys | set(EVAL_KEYS))]
    assert not extra, f"evaluated rows with other keys than {EVAL_KEYS}: {extra}"
    return set(keys)
