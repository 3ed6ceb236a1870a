"""`reward.scorer: function`: a user's Python reward function, called as verl calls `compute_score`.

    reward:
      scorer: function
      function: rewards/gsm8k.py:compute_score     # FILE.py[:NAME], NAME defaults to compute_score

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

The arguments an item gives it (rlslurm/reward/items.py builds the item from a data row):

- data_source   the row's `data_source` column ("" when it has none);
- solution_str  the response, as decoded text;
- ground_truth  the row's reference (verl: `reward_model.ground_truth`) as it was in the file: text stays
                text (never parsed, "72" stays "72"); a list, dict or number comes back as that value
                (the item carries it JSON-encoded with `reference_is_json` set);
- extra_info    the row's `extra_info` column when it has one (verl's layout), else a dict of all the
                row's columns other than prompt, reference and tests.

It may return a bool, int or float (any finite value: rewards are not clamped to [0, 1]; GRPO normalises
per group), or a dict with "score" (its other keys go into the reason). A raise, a non-number, NaN or
inf leaves the item unscored with the reason; a call past `reward.timeout_s` is an error and its worker
is killed and replaced (workers.py). Either way `reward.degrade` decides, as for any unscorable item.

The function is trusted code (the user's own reward, as in verl): it runs as the service's user in the
service's worker processes, unlike model-written code, which only ever runs in the sandbox.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlslurm.errors import ConfigError
from rlslurm.reward.config import DEFAULT_NAME, split_spec
from rlslurm.reward.items import Item, Scored
from rlslurm.reward.workers import WorkerFailed, WorkerPool


def load_function(spec: str) -> tuple[Callable[..., Any], str]:
    """Import FILE.py and return (its NAME, "FILE.py:NAME"); ConfigError naming reward.function when the file
    cannot be imported or NAME is no callable taking verl's four arguments."""
    path, name = split_spec(spec)
    where = f"reward.function = {spec!r}"
    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(f"{where}: {path} is not a .py file (a path relative to the working directory "
                          f"{Path.cwd()}, then an optional :NAME, default {DEFAULT_NAME})")
    # Modules beside it import as they do under verl (its directory first on sys.path).
    sys.path.insert(0, str(path.resolve().parent))
    module_spec = importlib.util.spec_from_file_location(f"rlslurm_reward_function_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # a user's file: any error at import is a config error with its cause
        raise ConfigError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:10]
        raise ConfigError(f"{where}: {path} defines no function {name!r} (callables there: {found})")
    try:
        inspect.signature(fn).bind("data_source", "solution", "truth", extra_info=None)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {name}{inspect.signature(fn)} cannot be called as "
                          f"{name}(data_source, solution_str, ground_truth, extra_info=None): {e}") from e
    return fn, f"{path.name}:{name}"


def verl_arguments(item: Item) -> dict[str, Any]:
    """The keyword arguments of a compute_score call for `item` (the module docstring's rule)."""
    truth: Any = item.reference
    if item.reference_is_json:
        truth = json.loads(item.reference)
    extra = json.loads(item.extra) if item.extra else {}
    extra_info = extra.get("extra_info") if isinstance(extra, dict) and "extra_info" in extra else extra
    return {"data_source": item.data_source, "solution_str": item.response, "ground_truth": truth,
            "extra_info": extra_info}


@dataclass
class FunctionScorer:
    """Scores each item with the user's function in a worker process (workers.py)."""

    pool: WorkerPool

    @classmethod
    def start(cls, spec: str, workers: int) -> "FunctionScorer":
        path, name = split_spec(spec)
        # Absolute: the worker imports the file the service's working directory meant.
        return cls(WorkerPool(["--function", f"{path.resolve()}:{name}"], workers, f"reward.function {spec}"))

    async def score(self, item: Item) -> Scored:
        try:
            reply = await self.pool.call(verl_arguments(item))
        except WorkerFailed as e:
            return Scored(None, str(e))
        return Scored(reply["score"], reply["reason"])

    async def warm(self) -> None:
        """Start the workers (at service start): the file is imported before the first item waits on it."""
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()
