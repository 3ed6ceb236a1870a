"""The rows of one split as Samples, read on demand from a memory-mapped `datasets.Dataset`.

    table = SampleTable(ds, layout, "data.train = train.jsonl", need=frozenset({"completion"}))
    len(table); table.sample(i)            # DataError naming file, row and column
    table.try_sample(i)                    # Sample, or the RowError (the run-time skip-and-count path)
    BadRows(job.data.max_bad_share).add(drawn=16, bad=1, last="...")   # BadRowShareError past the share

`rlslurm validate` reads the first data.check_rows rows of a file, so a bad row further on is found only when
a step draws it: one is skipped (a step does not fail for it); many mean the file is not what the job thinks it
is, and training on what is left would hide that, so past data.max_bad_share of the rows drawn so far the job
stops with BadRowShareError, naming the file, row and column of the last one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.data.layout import DataError, Layout, RowError
from rlslurm.data.sample import Sample


@dataclass(frozen=True)
class SampleTable:
    """One split: `dataset` (a datasets.Dataset, a selection of one, or the generated task's list of rows), its
    layout and where it came from."""

    dataset: object
    layout: Layout
    source: str
    """How errors name it: `data.train = path` (or the generated task)."""
    need: frozenset[str] = frozenset()
    """Sample fields this job needs in every row (see Layout.sample)."""
    rows: tuple[int, ...] | None = None
    """Row numbers in the file of each entry (an eval_fraction split); None: entry i is row i."""

    def __len__(self) -> int:
        return len(self.dataset)

    def file_row(self, i: int) -> int:
        return self.rows[i] if self.rows is not None else i

    def try_sample(self, i: int) -> Sample | RowError:
        try:
            return self.layout.sample(self.dataset[i], self.file_row(i), need=self.need)
        except RowError as e:
            return e

    def sample(self, i: int) -> Sample:
        got = self.try_sample(i)
        if isinstance(got, RowError):
            raise row_error(self.source, self.file_row(i), got)
        return got

    def samples(self) -> list[Sample]:
        """Every row (a held-out set, a generated task): DataError at the first bad one."""
        return [self.sample(i) for i in range(len(self))]


def row_error(source: str, row: int, e: RowError, line: int | None = None) -> DataError:
    """The message every data check and run-time refusal uses: file, row (as `datasets` counts, from 0; and
    the line of a .jsonl or .json file where known), column, what is wrong."""
    where = f"row {row}" + (f" (line {line})" if line is not None else "")
    return DataError(f"{source}: {where}, column {e.column!r}: {e.message}")


class BadRowShareError(DataError):
    """More of the rows drawn at run time broke the data layout's rules than data.max_bad_share allows."""


@dataclass
class BadRows:
    """The run's count of rows drawn and rows skipped as bad (saved in checkpoints: a resumed run goes on
    counting from there)."""

    max_share: float
    drawn: int = 0
    bad: int = 0
    last: str | None = None
    """The last bad row: file, row and column, what is wrong (rlslurm/data/table.py's row_error)."""

    def add(self, drawn: int, bad: int, last: str | None = None) -> None:
        """Count `drawn` rows of which `bad` were skipped; BadRowShareError once bad / drawn > max_share."""
        self.drawn, self.bad = self.drawn + drawn, self.bad + bad
        self.last = last or self.last
        if self.bad > self.max_share * self.drawn:
            raise BadRowShareError(
                f"{self.bad} of the {self.drawn} training rows drawn so far broke the data layout's rules, past "
                f"data.max_bad_share = {self.max_share:g}; the last: {self.last} (fix the rows: `rlslurm validate "
                f"--set data.check_rows=N` reads N of them; or raise data.max_bad_share to skip them)")

    def state(self) -> dict:
        return {"drawn": self.drawn, "bad": self.bad}
