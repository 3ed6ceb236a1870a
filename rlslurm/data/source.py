"""A user's data file opened with Hugging Face `datasets`: Arrow, memory-mapped, nothing from a hub.

    ds = open_dataset("data/train.jsonl", "data.train")    # .jsonl | .json | .parquet | save_to_disk dir

A rank holds the Arrow file mapped, not the rows: a 1M-row parquet costs each rank pages it touches.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlslurm.data.config import SUFFIXES
from rlslurm.data.layout import DataError


def _datasets():
    # Set before the first import: `datasets` reads its offline switch once, at import.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def kind_of(path: str | Path, key: str) -> str:
    """'jsonl', 'json', 'parquet' or 'dir' for an existing path; DataError naming `key` otherwise."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{key} = {str(path)!r}: no such file or directory (relative paths are read from the "
                        f"working directory, {os.getcwd()})")
    if p.is_dir():
        if not (p / "dataset_info.json").exists() and not (p / "dataset_dict.json").exists():
            raise DataError(f"{key} = {str(path)!r} is a directory but not one datasets.save_to_disk wrote "
                            f"(no dataset_info.json or dataset_dict.json)")
        return "dir"
    if p.suffix not in SUFFIXES:
        raise DataError(f"{key} = {str(path)!r}: unknown file type {p.suffix or '(none)'!r}; use "
                        f"{', '.join(SUFFIXES)} or a datasets.save_to_disk directory")
    return p.suffix[1:]


def open_dataset(path: str | Path, key: str):
    """The rows at `path` as a `datasets.Dataset`; DataError naming `key` when they cannot be read."""
    kind = kind_of(path, key)
    datasets = _datasets()
    try:
        if kind == "dir":
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds and len(ds) != 1:
                    raise DataError(f"{key} = {str(path)!r} holds the splits {sorted(ds)}; name one directory "
                                    f"(save each split with save_to_disk)")
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            return ds
        builder = "json" if kind in ("json", "jsonl") else "parquet"
        return datasets.load_dataset(builder, data_files=str(Path(path).resolve()), split="train")
    except DataError:
        raise
    except Exception as e:  # datasets wraps every reader's error in its own classes
        raise DataError(f"{key} = {str(path)!r}: cannot be read as {kind} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:300] if str(e) else ''}); `rlslurm validate` names the bad "
                        f"row") from None


def from_rows(rows: list[dict]) -> list[dict]:
    """Generated rows (the arithmetic task), in memory, as a SampleTable reads a `datasets.Dataset` (len, [i]).
    Not a Dataset: no user's file is read, and importing `datasets` (pyarrow) cost the rank that holds the data
    +83 MB and 0.4 s of its start (issue 36); a user's file is still read with it (`open_dataset`)."""
    return list(rows)
