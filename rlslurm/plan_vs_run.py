"""The plan meets the run: every figure `rlslurm plan` predicted for a job's chosen layout, next to what the
run measured, with the ratio; and what a run measured as the constants of `rlslurm plan --from-run`.

    rows = plan_vs_measured(run)          # [{figure, planned, measured, ratio}], `rlslurm report --json`
    off = check(run, step)                # rank 0, once: a `plan_off` event per figure off by more than 10 %
    cal = calibration(run)                # Calibration for another job's plan (rlslurm/plan/calibration.py)

The planned side is <run>/plan.json, the plan `rlslurm submit` printed and the job ran under (its chosen
option: placement, split, sync method). The measured side is <run>/metrics.jsonl: each phase's median over the
steady steps (the first step, which warms caches and allocators up, is left out when there are others), the
trainer peak's worst metered step and rank (rlslurm/memory_meter.py), and each checkpoint_saved event's seconds.
"""

from __future__ import annotations

import json
import statistics

from rlslurm import events
from rlslurm.plan.calibration import Calibration
from rlslurm.rundir import RunDir, read_jsonl

OFF_RATIO = 0.10
"""A steady-state figure more than this far from the plan (either way) is a `plan_off` event."""
CHECK_STEP = 5
"""The step at which a run compares itself with its plan (or its last, when it runs fewer)."""
FIGURES = {"rl": ("trainer_peak_gb", "rollout_s", "reward_s", "train_s", "sync_s", "step_s",
                  "effective_samples_per_s"),
           "sft": ("trainer_peak_gb", "train_s", "step_s")}
"""The figures each kind of run compares, in the order `rlslurm report` prints them."""


def planned(plan: dict, kind: str) -> dict[str, float | None]:
    """The chosen option's figures of a plan.json (rlslurm/plan/render.py as_json)."""
    chosen = plan["chosen"]
    split = next(s for s in plan["splits"] if s["train_gpus"] == chosen["train_gpus"]
                 and s["rollout_nodes"] == chosen["rollout_nodes"])
    option = next(o for o in plan["options"] if (o["placement"], o["rollout_nodes"], o["sync_method"]) == (
        chosen["placement"], chosen["rollout_nodes"], chosen["sync_method"]))
    peak, acts = split.get("peak_gb"), split.get("peak_activations_gb")
    out: dict[str, float | None] = {"trainer_peak_gb": peak, "activations_gb": acts,
                                    "resident_at_peak_gb": peak - acts if peak is not None and acts is not None
                                    else None}
    if kind == "rl":
        out.update({k: option[k] for k in ("rollout_s", "reward_s", "train_s", "sync_s")})
        out["step_s"] = option["total_s"]
        out["overlapped"] = option.get("overlapped", False)
        # Every sample reaches the loss unless a calibration measured the share that did (zero-variance groups).
        share = (plan.get("calibration") or {}).get("effective_share") or 1.0
        out["effective_samples_per_s"] = (plan["reward"]["responses"] * share / option["total_s"]
                                          if option["total_s"] else None)
    else:
        out["train_s"] = out["step_s"] = split.get("train_step_s")
    return out


def _median(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def measured(run: RunDir) -> tuple[str, dict[str, float | None], list[float] | None]:
    """(kind, figures, the worst metered step's trainer peak per rank) of a run's metrics.jsonl and events."""
    kind, rows = step_rows(run)
    steady = rows[1:] or rows
    out: dict[str, float | None] = {}
    if kind == "rl":
        for key in ("rollout_s", "reward_s", "train_s", "sync_s", "step_s", "effective_samples_per_s"):
            out[key] = _median(steady, key)
        samples = sum(r.get("samples") or 0 for r in rows)
        out["effective_share"] = sum(r.get("effective_samples") or 0 for r in rows) / samples if samples else None
    else:
        out["train_s"] = out["step_s"] = _median(steady, "step_s")
    metered = [r for r in rows if r.get("trainer_peak_gb") is not None]
    worst = max(metered, key=lambda r: r["trainer_peak_gb"]) if metered else None
    out["trainer_peak_gb"] = worst["trainer_peak_gb"] if worst else None
    saves = [e["seconds"] for e in events.read_events(run) if events.CHECKPOINT_SAVED.matches(e) and "seconds" in e]
    out["checkpoint_s"] = statistics.median(saves) if saves else None
    return kind, out, (worst or {}).get("trainer_peak_gb_by_rank")


def step_rows(run: RunDir) -> tuple[str, list[dict]]:
    """(rl | sft | other, one row per step: the last one written wins, as after a resume)."""
    records = read_jsonl(run.metrics)
    kind = "sft" if any(r.get("kind") == "sft_step" for r in records) else \
        "rl" if any("rollout_s" in r for r in records) else "other"
    keep = {"rl": lambda r: "rollout_s" in r, "sft": lambda r: r.get("kind") == "sft_step"}.get(kind)
    by_step = {int(r["step"]): r for r in records if keep and keep(r) and "step" in r}
    return kind, [by_step[s] for s in sorted(by_step)]


def compare(plan: dict, kind: str, found: dict) -> list[dict]:
    """[{figure, planned, measured, ratio}] of every figure `kind` compares (ratio = measured / planned)."""
    want = planned(plan, kind)
    rows = []
    for figure in FIGURES.get(kind, ()):
        p, m = want.get(figure), found.get(figure)
        ratio = m / p if p and m is not None else None
        rows.append({"figure": figure, "planned": p, "measured": m, "ratio": ratio})
    return rows


def plan_vs_measured(run: RunDir) -> dict | None:
    """What `rlslurm report --json` shows: the comparison rows, the peak per rank; None without a plan.json."""
    if not run.plan.is_file():
        return None
    kind, found, by_rank = measured(run)
    if kind not in FIGURES:
        return None
    return {"rows": compare(json.loads(run.plan.read_text()), kind, found), "trainer_peak_gb_by_rank": by_rank}


def check(run: RunDir, step: int) -> list[dict]:
    """Rank 0 at CHECK_STEP: a `plan_off` event for each figure more than OFF_RATIO from the plan; the rows."""
    found = plan_vs_measured(run)
    off = [r for r in (found or {}).get("rows", []) if r["ratio"] is not None and abs(r["ratio"] - 1) > OFF_RATIO]
    for r in off:
        events.emit(run, events.PLAN_OFF, step=step, figure=r["figure"], planned=round(r["planned"], 6),
                    measured=round(r["measured"], 6), ratio=round(r["ratio"], 4),
                    fix="calibrate the plan from this run: rlslurm plan CONFIG --from-run " + str(run.path))
    return off


def calibration(run: RunDir) -> Calibration:
    """The run's measured constants, as rlslurm/plan/calibration.py carries them to another job's plan."""
    plan = json.loads(run.plan.read_text())
    kind, found, _ = measured(run)
    return Calibration.from_figures(str(run.path), planned(plan, kind), found,
                                    responses=plan["reward"]["responses"] if kind == "rl" else 0,
                                    params=plan["params"]["total_params"], lengths_vary=kind == "rl")

