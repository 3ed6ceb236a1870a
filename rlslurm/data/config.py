"""`data:` in a job YAML: the user's own dataset, its layout and its column names.

    data:
      train: data/train.jsonl          # .jsonl, .json, .parquet, or a directory of datasets.save_to_disk
      eval_fraction: 0.1               # or  eval: data/test.parquet
      layout: auto                     # verl | trl_prompt_completion | trl_messages | columns
      columns: {reference: reward_model.ground_truth}

Without `data.train` the job trains on `task:` (the generated arithmetic), read through the same Sample path.
Relative paths are read from the working directory of the command, as train.init_from is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlslurm.configfile import check, check_path, check_range

LAYOUTS = ("auto", "verl", "trl_prompt_completion", "trl_messages", "columns")
SUFFIXES = (".jsonl", ".json", ".parquet")


def check_column(value: str | None, key: str) -> None:
    """A column key: a dotted path of names (reward_model.ground_truth), each 1 to 64 characters."""
    if value is None:
        return
    parts = value.split(".")
    check(len(parts) <= 8 and all(0 < len(p) <= 64 and p == p.strip() and p.isprintable() for p in parts), key,
          "must be a column name or a dotted path into a struct column (reward_model.ground_truth): at most 8 "
          "parts of 1 to 64 printable characters")


@dataclass(frozen=True, kw_only=True)
class ColumnsConfig:
    prompt: str | None = None
    """Column of the prompt (text, or a list of {role, content} messages); default: the layout's (`prompt`)."""
    completion: str | None = None
    """Column of the SFT target text (or assistant messages); default: the layout's (`completion`)."""
    messages: str | None = None
    """Column of a whole conversation (TRL's conversational form); default: the layout's (`messages`)."""
    reference: str | None = None
    """Column of the ground truth the reward compares with; default: verl's reward_model.ground_truth, else
    the first of ground_truth, answer, solution, reference present."""
    tests: str | None = None
    """Column of a code problem's tests (HumanEval's `test`); default: `test` when present."""

    def __post_init__(self):
        for name in ("prompt", "completion", "messages", "reference", "tests"):
            check_column(getattr(self, name), name)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: str | None = None
    """Training rows: a .jsonl, .json or .parquet file, or a directory written by datasets.save_to_disk.
    Unset: the job trains on `task:` (the generated arithmetic)."""
    eval: str | None = None
    """Held-out rows (same forms as train); or set eval_fraction instead."""
    eval_fraction: float | None = None
    """Share of train held out for evaluation, chosen by `seed` (instead of eval). Range (0, 0.5]."""
    seed: int = 0
    """Seed of the eval_fraction split (the training order is train.seed's). Range [0, 4294967295]."""
    layout: Literal["auto", "verl", "trl_prompt_completion", "trl_messages", "columns"] = "auto"
    """What the columns mean: verl (prompt messages, reward_model.ground_truth), trl_prompt_completion
    (prompt [+ completion]), trl_messages (messages), columns (only what `columns` names); auto = detected
    from the column names."""
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    """Column keys that override the layout's own."""
    too_long: Literal["drop", "truncate"] = "drop"
    """A training row longer than model.max_positions: drop = skip it, truncate = cut its completion; either
    way counted in the step metrics and a `data_too_long` event."""
    max_bad_share: float = 0.01
    """Share of the training rows drawn so far that may break the layout's rules at run time (each is skipped and
    counted, `data_bad_rows`) before the job stops with a BadRowShareError naming the last one; 0 = stop at
    the first, 1 = never stop. Range [0, 1]."""
    check_rows: int = 1000
    """Rows of each file `rlslurm validate` and `submit` read and check before anything runs. Range [1, 1000000]."""
    check_time_s: float = 20.0
    """Seconds those checks may read for, per file, before they stop at the rows read. Range (0, 600]."""

    def __post_init__(self):
        for key in ("train", "eval"):
            check_path(getattr(self, key), key)
        check_range(self.eval_fraction, "eval_fraction", 0, 0.5, low_open=True, note="share of train")
        check_range(self.seed, "seed", 0, 2**32 - 1)
        check_range(self.max_bad_share, "max_bad_share", 0, 1, note="share of the rows drawn")
        check_range(self.check_rows, "check_rows", 1, 1_000_000, note="rows")
        check_range(self.check_time_s, "check_time_s", 0, 600, low_open=True, note="seconds")
        if self.train is None:
            check(self.eval is None and self.eval_fraction is None, "eval" if self.eval else "eval_fraction",
                  "needs data.train (without it the job trains on task:, the generated arithmetic)")
            return
        check(not (self.eval and self.eval_fraction), "eval_fraction",
              f"and data.eval = {self.eval!r} both choose the held-out rows; set one of them")
        check(bool(self.eval) or self.eval_fraction is not None, "eval",
              "or data.eval_fraction is required with data.train: the held-out rows evaluation reports on")
        if self.layout == "columns":
            check(self.columns.prompt is not None or self.columns.messages is not None, "columns.prompt",
                  "is required with data.layout = columns (the column of the prompt; or columns.messages)")
