"""Rows of the plan's truth table (bench/bench_plan.py), held: the trainer peak the plan predicts against the
peak the memory meter measures, each shape's step in a process of its own.

    python -m pytest -q tests/integration/test_plan_truth.py     # ~1 min on 2 cores

Memory only: live tensor bytes are a count, the same on any kernel path and load. The step-time columns of
the table are a benchmark (docs/planner.md), not asserted here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan", ROOT / "bench" / "bench_plan.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_planned_peak_holds_uncalibrated_and_calibrated_and_fused_ce_saves_the_logits_it_plans_away():
    bench = _bench()
    # The demo's tiny model at two shapes (each calibrates the other), and a 32k vocabulary plain and fused.
    names = ["tiny-demo", "tiny-64", "wide-32k", "wide-32k-fused"]
    rows, _ = bench.table(names, bench.measure_all(names))
    by = {r["shape"]: r for r in rows}
    for r in rows:
        assert abs(r["peak_err_pct"]) <= 15, r
        assert r["cal_peak_err_pct"] is None or abs(r["cal_peak_err_pct"]) <= 10, r
    assert by["tiny-demo"]["cal_peak_err_pct"] is not None and by["tiny-64"]["cal_peak_err_pct"] is not None
    # Where logits dominate, what fused CE measurably saves is at least 80 % of the term the plan removes.
    (fused,) = bench.fused_savings(rows)
    assert fused["plain"] == "wide-32k" and fused["share"] >= 0.8, fused
    assert by["wide-32k-fused"]["measured_peak_gb"] < by["wide-32k"]["measured_peak_gb"]
