"""The rows of one split as Samples, read on demand from a memory-mapped `datasets.Dataset`.

    table = SampleTable(ds, layout, "data.train = train.jsonl", need=frozenset({"completion"}))
    len(table); table.sample(i)            # DataError naming file, row and column
    table.try_sample(i)                    # Sample, or the RowError (the run-time skip-and-count path)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlslurm.data.layout import DataError, Layout, RowError
from rlslurm.data.sample import Sample


@dataclass(frozen=True)
class SampleTable:
    """One split: `dataset` (a datasets.Dataset, or a selection of one), its layout and where it came from."""

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
