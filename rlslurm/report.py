"""`rlslurm report <jobid|rundir>`: one PNG and one self-contained HTML page of a run's per-step metrics.

    rlslurm report runs/tiny-grpo-20261201-004207      # writes <run>/report/report.png and report.html
    rlslurm report 1234 --run-root runs                # a job id recorded by submit

Reads only <run>/metrics.jsonl and <run>/events.jsonl. An RL run gets the per-step split of rollout /
reward (as far as the trainer waited for them: a rollout ahead of the trainer, rl.max_staleness, runs beside
training) / train / sync / idle (idle = step_s minus the four: broadcasts, bookkeeping), effective
samples per second, reward and held-out accuracy, reward-degraded ratio and policy staleness. An SFT run
(`kind: sft_step` lines) gets loss, learning rate and step time; any other run with a `loss` per step (the
toy job) gets its loss curve. What a run did not record is named in the page, not silently left out.
Events that change a run's course (resume, requeue, hang, failed sync, drain) are marked on every panel.
"""

from __future__ import annotations

import base64
import html
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rlslurm import events
from rlslurm.errors import RunDirError
from rlslurm.rundir import RunDir, current_names, read_jsonl

PHASES = ("rollout", "reward", "train", "sync")
SPLIT = ("rollout_waited", "reward_waited", "train", "sync", "idle")
"""What a step's seconds stack up to: rollout and reward only as far as the trainer waited for them."""
PHASE_COLORS = {"rollout_waited": "#4C72B0", "reward_waited": "#DD8452", "train": "#55A868", "sync": "#C44E52",
                "idle": "#BBBBBB"}
# Events worth a vertical line: each marks a point where the run did not simply go on.
MARKED_EVENTS = (events.RESUME, events.REQUEUE, events.HANG_DETECTED, events.SYNC_FAILED, events.SYNC_VERIFY_MISMATCH,
                 events.SYNC_VERIFY_FAILED, events.ENGINE_FAILED, events.DRAINED, events.REWARD_SERVICE_DIED,
                 events.REWARD_SERVICE_RESTARTED, events.REWARD_SERVICE_DOWN, events.CHECKPOINT_SKIPPED,
                 events.NO_PROGRESS)
# Columns of the per-step HTML table, in order; only those a run recorded are shown.
TABLE_COLUMNS = {
    "rl": ("step", "step_s", "rollout_s", "reward_s", "experience_wait_s", "train_s", "sync_s", "idle_s",
           "effective_samples",
           "effective_samples_per_s", "tokens_per_s", "reward_mean", "held_out_accuracy",
           "reward_degraded_ratio", "staleness_max", "sync_update_gbps", "loss"),
    "sft": ("step", "loss", "lr", "grad_norm", "step_s"),
    "toy": ("step", "loss", "restart_count"),
}


@dataclass
class RunMetrics:
    """What one run recorded, ready to plot: one record per step (the last one written wins, so a step
    repeated after a resume shows its final numbers), evaluations, marked events and what is missing."""

    run_dir: Path
    kind: str  # "rl", "sft", "toy" or "empty"
    steps: list[dict] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out accuracy)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (step, event kind)
    event_counts: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that carry `key`."""
        pts = [(r["step"], float(r[key])) for r in self.steps if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def has(self, key: str) -> bool:
        return any(r.get(key) is not None for r in self.steps)


def load(run: RunDir) -> RunMetrics:
    """Read a run's metrics and events into a RunMetrics; raises RunDirError if neither file exists."""
    records = read_jsonl(run.metrics)
    said = events.read_events(run)
    if not records and not said:
        raise RunDirError(f"{run.path} has neither metrics.jsonl nor events.jsonl: nothing to report")
    kind = _kind(records)
    by_step: dict[int, dict] = {}
    for r in records:
        if _is_step_record(r, kind):
            by_step[int(r["step"])] = dict(r)
    steps = [by_step[s] for s in sorted(by_step)]
    data = RunMetrics(run.path, kind, steps)
    if kind == "rl":
        for r in steps:
            _waited_split(r)
    data.evals = _evals(records, said, steps)
    data.marks, data.event_counts = _marks(said, steps)
    data.missing = _missing(data)
    return data


def _waited_split(r: dict) -> None:
    """A step row's split of step_s: `rollout_waited_s` and `reward_waited_s` (the part of each the trainer waited
    for: all of it in turn, less where the rollout ran ahead beside training, rl.max_staleness), train, sync and
    `idle_s` (the rest: broadcasts, bookkeeping). Rows without `experience_wait_s` (runs before it) waited for all."""
    rollout_s, reward_s = r.get("rollout_s") or 0.0, r.get("reward_s") or 0.0
    wait_s = r.get("experience_wait_s")
    share = 1.0 if wait_s is None or rollout_s + reward_s <= 0 else min(1.0, wait_s / (rollout_s + reward_s))
    r["rollout_waited_s"], r["reward_waited_s"] = rollout_s * share, reward_s * share
    if r.get("step_s") is not None:
        # Negative only by clock jitter; the split must still stack to step_s.
        r["idle_s"] = max(r["step_s"] - sum(r.get(f"{p}_s") or 0.0 for p in SPLIT[:-1]), 0.0)


def _kind(records: list[dict]) -> str:
    if any(r.get("kind") == "sft_step" for r in records):
        return "sft"
    if any("rollout_s" in r for r in records):
        return "rl"
    if any("loss" in r and "step" in r for r in records):
        return "toy"
    return "empty"


def _is_step_record(r: dict, kind: str) -> bool:
    if "step" not in r or r.get("final"):
        return False
    if kind == "sft":
        return r.get("kind") == "sft_step"
    if kind == "rl":
        return "rollout_s" in r
    return "loss" in r


def _evals(records: list[dict], said: list[dict], steps: list[dict]) -> list[tuple[int, float]]:
    found: dict[int, float] = {}
    for e in said:  # the RL job evaluates the starting policy at step 0 as an event
        if events.EVAL.matches(e) and e.get("held_out_accuracy") is not None:
            found[int(e.get("step", 0))] = float(e["held_out_accuracy"])
    for r in map(current_names, records):  # an old SFT run spelled it heldout_accuracy
        if r.get("held_out_accuracy") is not None and "step" in r:
            found[int(r["step"])] = float(r["held_out_accuracy"])
    return sorted(found.items())


def _marks(said: list[dict], steps: list[dict]) -> tuple[list[tuple[int, str]], dict[str, int]]:
    counts: dict[str, int] = {}
    marks = []
    for e in said:
        kind = str(e.get("kind"))
        counts[kind] = counts.get(kind, 0) + 1
        if events.kind_of(e) not in MARKED_EVENTS:
            continue
        step = e.get("step")
        if step is None:  # place it at the first step recorded after it happened
            later = [r["step"] for r in steps if r.get("t", 0) >= e.get("t", 0)]
            step = later[0] if later else (steps[-1]["step"] if steps else 0)
        marks.append((int(step), kind))
    return marks, counts


def _missing(data: RunMetrics) -> list[str]:
    if data.kind == "empty":
        return ["no per-step metrics in metrics.jsonl (the run may not have reached its first step)"]
    wanted = {"rl": ["step_s", *(f"{p}_s" for p in PHASES), "effective_samples_per_s", "reward_mean",
                     "reward_degraded_ratio", "staleness_max", "tokens_per_s"],
              "sft": ["loss", "lr", "step_s"], "toy": ["loss"]}[data.kind]
    out = [f"{key}: not recorded by this run" for key in wanted if not data.has(key)]
    if data.kind in ("rl", "sft") and not data.evals:
        out.append("held-out accuracy: no evaluation recorded")
    if data.kind == "toy":
        out.append("step time split, samples/s, reward: a toy run records only its loss")
    return out


def summary(data: RunMetrics) -> dict[str, object]:
    """The headline numbers, as (label -> value) in display order."""
    out: dict[str, object] = {"run": str(data.run_dir), "kind": data.kind, "steps recorded": len(data.steps)}
    if data.steps:
        out["steps"] = f"{data.steps[0]['step']} .. {data.steps[-1]['step']}"
    total_s = sum(r.get("step_s") or 0.0 for r in data.steps)
    if total_s:
        out["time in steps (s)"] = round(total_s, 2)
        out["median step (s)"] = round(statistics.median(r["step_s"] for r in data.steps if r.get("step_s")), 4)
    if data.kind == "rl" and total_s:
        for name in SPLIT:
            phase_s = sum(r.get(f"{name}_s") or 0.0 for r in data.steps)
            out[f"{name.replace('_waited', '')} share of step time"] = f"{100 * phase_s / total_s:.1f} %"
        made_s = sum((r.get("rollout_s") or 0.0) + (r.get("reward_s") or 0.0) for r in data.steps)
        waited_s = sum(r["rollout_waited_s"] + r["reward_waited_s"] for r in data.steps)
        if made_s and made_s - waited_s > 0.005 * made_s:  # the rollout ran ahead (rl.max_staleness)
            out["rollout + reward beside training"] = f"{100 * (made_s - waited_s) / made_s:.1f} % of their time"
        effective = sum(r.get("effective_samples") or 0 for r in data.steps)
        out["effective samples per s (whole run)"] = round(effective / total_s, 1)
        for key, label in (("reward_mean", "reward mean (last step)"),
                           ("reward_degraded_ratio", "reward degraded ratio (max)"),
                           ("staleness_max", "policy staleness (max)"),
                           ("sync_update_gbps", "sync update GB/s (median)")):
            _, values = data.series(key)
            if values:
                pick = {"reward_mean": values[-1], "sync_update_gbps": statistics.median(values)}.get(key, max(values))
                out[label] = round(pick, 4)
    _, losses = data.series("loss")
    if losses and data.kind != "rl":
        out["loss first -> last"] = f"{losses[0]:.4f} -> {losses[-1]:.4f}"
    if data.evals:
        out["held-out accuracy first -> last"] = f"{data.evals[0][1]:.3f} (step {data.evals[0][0]}) -> " \
                                                 f"{data.evals[-1][1]:.3f} (step {data.evals[-1][0]})"
    interesting = {k: v for k, v in sorted(data.event_counts.items()) if k != events.SYNC_VERIFIED.name}
    if interesting:
        out["events"] = ", ".join(f"{k} x{v}" for k, v in interesting.items())
    return out


def render_html(data: RunMetrics, png: bytes, versus: dict | None = None) -> str:
    """A self-contained page: summary, the plan against the run, what is missing, the figure (base64) and the
    per-step table."""
    esc = html.escape
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in summary(data).items())
    plan_rows = "".join(f"<tr><th>{esc(r['figure'])}</th><td>{_fmt(r['planned'])}</td><td>{_fmt(r['measured'])}</td>"
                        f"<td>{_fmt(r['ratio'])}</td></tr>" for r in (versus or {}).get("rows", []))
    plan_table = (f"<h2>Plan vs measured</h2><table><tr><th>figure</th><th>planned</th><th>measured</th>"
                  f"<th>measured / planned</th></tr>{plan_rows}</table>") if plan_rows else ""
    missing = "".join(f"<li>{esc(m)}</li>" for m in data.missing)
    evals = dict(data.evals)
    columns = [c for c in TABLE_COLUMNS.get(data.kind, ("step",))
               if c == "step" or data.has(c) or (c == "held_out_accuracy" and evals)]
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = []
    for r in _table_rows(data.steps, set(evals)):
        cells = {**r, "held_out_accuracy": r.get("held_out_accuracy", evals.get(r["step"]))}
        body.append("<tr>" + "".join(f"<td>{_fmt(cells.get(c))}</td>" for c in columns) + "</tr>")
    image = base64.b64encode(png).decode()
    note = (f"<p>{len(body)} of {len(data.steps)} steps shown; all of them are in metrics.jsonl.</p>"
            if len(body) < len(data.steps) else "")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>rlslurm report: {esc(data.run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}} th{{background:#f3f3f3}}
.summary th{{text-align:left}} img{{max-width:100%}}</style></head><body>
<h1>{esc(data.run_dir.name)} ({esc(data.kind)} run)</h1>
<h2>Summary</h2><table class="summary">{rows}</table>
{plan_table}
{f"<h2>Not in this run</h2><ul>{missing}</ul>" if missing else ""}
<h2>Per step</h2><img alt="per-step metrics" src="data:image/png;base64,{image}">
<h2>Per-step numbers</h2>{note}<table><tr>{head}</tr>{"".join(body)}</table>
</body></html>
"""


def _table_rows(steps: list[dict], keep: set[int], limit: int = 400) -> list[dict]:
    """Every step of a short run; of a long one every k-th, the evaluated steps and the last, so the page
    stays small (the figure and metrics.jsonl hold the rest)."""
    if len(steps) <= limit:
        return steps
    every = -(-len(steps) // limit)
    return [r for i, r in enumerate(steps) if i % every == 0 or r["step"] in keep or i == len(steps) - 1]


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


@dataclass(frozen=True)
class ReportFiles:
    png: Path
    html: Path
    data: RunMetrics


def write(run: RunDir, out_dir: Path | None = None, versus: dict | None = None) -> ReportFiles:
    """Load, plot and write <run>/report/report.png and report.html (or into out_dir); `versus`: the plan's
    figures against the run's (rlslurm/plan_vs_run.py), a table on the page."""
    data = load(run)
    folder = Path(out_dir) if out_dir else run.path / "report"
    folder.mkdir(parents=True, exist_ok=True)
    png = figure_png(data)
    (folder / "report.png").write_bytes(png)
    (folder / "report.html").write_text(render_html(data, png, versus))
    return ReportFiles(folder / "report.png", folder / "report.html", data)


# -- the figure ---------------------------------------------------------------------------------------

def figure_png(data: RunMetrics, dpi: int = 110) -> bytes:
    """The run's panels as PNG bytes (matplotlib, Agg: no display needed)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # a bare Figure: no pyplot global state, safe in any thread

    panels = {"rl": (_rl_split, _rl_throughput, _rl_quality, _rl_health),
              "sft": (_sft_loss, _step_time), "toy": (_toy_loss,)}.get(data.kind, ())
    rows = max(len(panels), 1)
    fig = Figure(figsize=(11, 2.9 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(f"{data.run_dir.name} ({data.kind} run, {len(data.steps)} steps)", fontsize=13)
    if not panels:
        axes[0].text(0.5, 0.5, "\n".join(data.missing), ha="center", va="center", transform=axes[0].transAxes)
        axes[0].set_axis_off()
    for ax, panel in zip(axes, panels):
        panel(ax, data)
        ax.grid(alpha=0.3)
        _mark_events(ax, data)
    if panels:
        axes[-1].set_xlabel("step")
        axes[-1].xaxis.get_major_locator().set_params(integer=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _mark_events(ax, data: RunMetrics) -> None:
    for step, kind in data.marks:
        ax.axvline(step, color="#7B3294", linestyle="--", linewidth=1, alpha=0.8)
        ax.annotate(kind, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    va="top", ha="right", color="#7B3294")


def _marker(data: RunMetrics) -> str | None:
    return "." if len(data.steps) <= 60 else None  # past that, dots merge into a thick line


def _absent(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not recorded by this run", ha="center", va="center",
            transform=ax.transAxes, color="#888888")


def _rl_split(ax, data: RunMetrics) -> None:
    steps = [r["step"] for r in data.steps]
    bottom = [0.0] * len(steps)
    total_s = sum(r.get("step_s") or 0.0 for r in data.steps) or 1.0
    for name in SPLIT:
        values = [r.get(f"{name}_s") or 0.0 for r in data.steps]
        label = f"{name.replace('_waited', ' (waited)')} {100 * sum(values) / total_s:.1f} %"
        top = [b + v for b, v in zip(bottom, values)]
        if len(steps) <= 120:
            ax.bar(steps, values, bottom=bottom, width=0.85, color=PHASE_COLORS[name], label=label, linewidth=0)
        else:  # bars thinner than a pixel alias into stripes: stack filled bands instead
            ax.fill_between(steps, bottom, top, step="mid", color=PHASE_COLORS[name], label=label, linewidth=0)
        bottom = top
    ax.set_ylabel("seconds per step")
    ax.set_title("step time split: rollout / reward (as far as waited for) / train / sync / idle", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _rl_throughput(ax, data: RunMetrics) -> None:
    if not data.has("effective_samples_per_s"):
        return _absent(ax, "effective_samples_per_s")
    ax.plot(*data.series("effective_samples_per_s"), color="#4C72B0", marker=_marker(data), label="effective samples/s")
    ax.set_ylabel("effective samples / s", color="#4C72B0")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput: samples that reached the loss with non-zero advantage, per second of step", fontsize=10)
    if data.has("tokens_per_s"):
        twin = ax.twinx()
        twin.plot(*data.series("tokens_per_s"), color="#999999", linestyle=":", label="generated tokens/s (rollout)")
        twin.set_ylabel("generated tokens / s", color="#777777")
        twin.set_ylim(bottom=0)
        twin.legend(loc="lower right", fontsize=8)
    ax.legend(loc="lower left", fontsize=8)


def _rl_quality(ax, data: RunMetrics) -> None:
    if data.has("reward_mean"):
        ax.plot(*data.series("reward_mean"), color="#55A868", marker=_marker(data),
                label="reward mean (rollout samples)")
    if data.evals:
        ax.plot([e[0] for e in data.evals], [e[1] for e in data.evals], color="#C44E52", marker="o",
                label="held-out accuracy (greedy)")
    if not data.has("reward_mean") and not data.evals:
        return _absent(ax, "reward and held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("fraction")
    ax.set_title("reward and held-out accuracy", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)


def _rl_health(ax, data: RunMetrics) -> None:
    if data.has("reward_degraded_ratio"):
        ax.plot(*data.series("reward_degraded_ratio"), color="#DD8452", marker=_marker(data),
                label="reward degraded ratio")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("degraded ratio", color="#DD8452")
        ax.legend(loc="upper left", fontsize=8)
    else:
        _absent(ax, "reward_degraded_ratio")
    if data.has("staleness_max"):
        twin = ax.twinx()
        steps, values = data.series("staleness_max")
        twin.step(steps, values, where="mid", color="#8172B3", label="policy staleness (max versions behind)")
        twin.set_ylim(-0.1, max(max(values), 1) + 0.5)
        twin.yaxis.get_major_locator().set_params(integer=True)
        twin.set_ylabel("staleness (versions)", color="#8172B3")
        twin.legend(loc="upper right", fontsize=8)
    ax.set_title("reward degradation and policy staleness", fontsize=10)


def _sft_loss(ax, data: RunMetrics) -> None:
    if not data.has("loss"):
        return _absent(ax, "loss")
    ax.plot(*data.series("loss"), color="#4C72B0", linewidth=1, label="training loss")
    ax.set_yscale("log")
    ax.set_ylabel("loss (log)", color="#4C72B0")
    title = "training loss and learning rate"
    if data.evals:
        step, acc = data.evals[-1]
        title += f"; held-out accuracy {acc:.3f} at step {step}"
    ax.set_title(title, fontsize=10)
    if data.has("lr"):
        twin = ax.twinx()
        twin.plot(*data.series("lr"), color="#DD8452", linewidth=1, label="learning rate")
        twin.set_ylabel("learning rate", color="#DD8452")
        twin.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper center", fontsize=8)


def _step_time(ax, data: RunMetrics) -> None:
    if not data.has("step_s"):
        return _absent(ax, "step_s")
    ax.plot(*data.series("step_s"), color="#55A868", linewidth=1)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("seconds per step")
    ax.set_title("step time", fontsize=10)


def _toy_loss(ax, data: RunMetrics) -> None:
    ax.plot(*data.series("loss"), color="#4C72B0", marker=".", linewidth=1)
    ax.set_ylabel("loss")
    ax.set_title("training loss (a toy run records nothing else)", fontsize=10)
