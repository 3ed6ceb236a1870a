"""rlslurm report on recorded runs: tests/data/report/{rl,sft} are metrics and events of real runs
(a 6-step tiny GRPO run from the tiny SFT export; the first 40 steps of that SFT run and its eval)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from rlslurm.cli.report import command
from rlslurm.errors import RunDirError
from rlslurm.report import load, summary, write
from rlslurm.rundir import RunDir, read_jsonl

DATA = Path(__file__).parent.parent / "data" / "report"


def copy_run(name: str, tmp_path: Path) -> RunDir:
    dest = tmp_path / f"run-{name}"
    shutil.copytree(DATA / name, dest)
    return RunDir(dest)


def rewrite(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_rl_split_stacks_to_step_time_and_evals_include_step_zero(tmp_path):
    data = load(copy_run("rl", tmp_path))
    assert data.kind == "rl" and [r["step"] for r in data.steps] == [1, 2, 3, 4, 5, 6]
    for r in data.steps:
        parts = r["rollout_s"] + r["reward_s"] + r["train_s"] + r["sync_s"] + r["idle_s"]
        assert r["idle_s"] >= 0 and parts == pytest.approx(r["step_s"], abs=1e-9)
    # step 0 comes from the `eval` event, step 6 from the metrics line
    assert [s for s, _ in data.evals] == [0, 6]
    assert data.missing == []


def test_summary_shares_add_up_to_the_whole_step(tmp_path):
    numbers = summary(load(copy_run("rl", tmp_path)))
    shares = [float(v.rstrip(" %")) for k, v in numbers.items() if k.endswith("share of step time")]
    assert len(shares) == 5 and sum(shares) == pytest.approx(100.0, abs=0.3)
    assert numbers["steps recorded"] == 6 and "held-out accuracy first -> last" in numbers


def test_a_rollout_ahead_of_the_trainer_counts_only_the_wait_in_the_split(tmp_path):
    """rl.max_staleness 1: step n + 1's rollout runs while step n trains, so rollout_s + train_s exceed step_s.
    The split stacks what the step waited for (`experience_wait_s`) and says how much training hid."""
    run = copy_run("rl", tmp_path)
    rows = read_jsonl(run.metrics)
    for r in rows:
        if "rollout_s" in r:  # rollout 0.08 + reward 0.02 made beside training, 0.01 of them waited for
            r.update(rollout_s=0.08, reward_s=0.02, experience_wait_s=0.01, train_s=0.07, sync_s=0.01, step_s=0.1)
    rewrite(run.metrics, rows)
    data = load(run)
    for r in data.steps:
        assert r["rollout_waited_s"] == pytest.approx(0.008) and r["reward_waited_s"] == pytest.approx(0.002)
        assert r["idle_s"] == pytest.approx(0.01)
    numbers = summary(data)
    shares = {k: float(v.rstrip(" %")) for k, v in numbers.items() if k.endswith("share of step time")}
    assert sum(shares.values()) == pytest.approx(100.0, abs=0.3) and shares["rollout share of step time"] == 8.0
    assert numbers["rollout + reward beside training"] == "90.0 % of their time"
    assert "rollout + reward beside training" not in summary(load(copy_run("rl", tmp_path / "sync")))


def test_write_embeds_the_png_and_one_table_row_per_step(tmp_path):
    run = copy_run("rl", tmp_path)
    files = write(run)
    assert files.png == run.path / "report" / "report.png" and files.html.is_file()
    png = files.png.read_bytes()
    with Image.open(io.BytesIO(png)) as img:
        assert img.format == "PNG" and img.width >= 800 and img.height >= 800
    page = files.html.read_text()
    embedded = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(embedded) == png
    table = page.split("<h2>Per-step numbers</h2>")[1]
    assert table.count("<tr>") == 1 + 6  # header + steps
    for column in ("rollout_s", "idle_s", "effective_samples_per_s", "staleness_max", "held_out_accuracy"):
        assert f"<th>{column}</th>" in table
    assert "Not in this run" not in page


def test_a_step_repeated_after_resume_keeps_its_last_record_and_the_resume_is_marked(tmp_path):
    run = copy_run("rl", tmp_path)
    records = read_jsonl(run.metrics)
    # A requeue after step 4 without a checkpoint at 4: steps 3 and 4 run again, later and slower.
    t_resume = records[-1]["t"] + 1.0
    again = [{**r, "t": t_resume + i + 1, "step_s": r["step_s"] + 5.0} for i, r in enumerate(records[2:4])]
    rewrite(run.metrics, records[:4] + again + records[4:])
    run.append_json(run.events, {"t": t_resume, "kind": "resume", "checkpoint": "step-00000002"})
    data = load(run)
    assert [r["step"] for r in data.steps] == [1, 2, 3, 4, 5, 6]
    assert data.steps[2]["step_s"] == pytest.approx(records[2]["step_s"] + 5.0)
    assert data.steps[2]["idle_s"] > 5.0
    assert data.marks == [(3, "resume")]  # no step in the event: placed at the first step recorded after it
    assert "resume x1" in summary(data)["events"]


def test_an_rl_run_missing_fields_says_so(tmp_path):
    run = copy_run("rl", tmp_path)
    drop = {"held_out_accuracy", "reward_degraded_ratio", "staleness_max"}
    rewrite(run.metrics, [{k: v for k, v in r.items() if k not in drop} for r in read_jsonl(run.metrics)])
    rewrite(run.events, [e for e in read_jsonl(run.events) if e["kind"] != "eval"])
    files = write(run)
    missing = " | ".join(files.data.missing)
    for what in ("reward_degraded_ratio", "staleness_max", "held-out accuracy"):
        assert what in missing
    assert "Not in this run" in files.html.read_text()
    assert "<th>staleness_max</th>" not in files.html.read_text()


def test_sft_run_plots_loss_and_lr(tmp_path):
    files = write(copy_run("sft", tmp_path))
    data = files.data
    assert data.kind == "sft" and len(data.steps) == 40 and data.missing == []
    assert data.evals == [(1600, pytest.approx(0.375))]
    numbers = summary(data)
    first, last = (float(x) for x in numbers["loss first -> last"].split(" -> "))
    assert first > last
    assert "<th>lr</th>" in files.html.read_text()


def test_toy_run_has_only_loss_and_says_what_is_missing(tmp_path):
    run = RunDir(tmp_path / "toy").create()
    rewrite(run.metrics, [{"t": 1.0 + s, "step": s, "loss": 1.0 / (s + 1), "restart_count": 0} for s in range(5)]
            + [{"t": 9.0, "final": True, "step": 5, "weights_sha256": "ab"}])
    files = write(run)
    assert files.data.kind == "toy" and len(files.data.steps) == 5
    assert any("toy run records only its loss" in m for m in files.data.missing)
    assert files.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_steps_still_reports_and_one_without_files_is_an_error(tmp_path):
    run = RunDir(tmp_path / "early").create()
    run.append_json(run.events, {"t": 1.0, "kind": "submitted", "job_id": "7"})
    files = write(run)
    assert files.data.kind == "empty" and "no per-step metrics" in files.data.missing[0]
    with pytest.raises(RunDirError, match="nothing to report"):
        load(RunDir(tmp_path / "nothing").create())


def test_cli_finds_the_run_by_job_id_and_writes_where_asked(tmp_path):
    run = copy_run("rl", tmp_path)
    run.append_json(run.path / "submissions.jsonl", {"job_id": "4242", "backend": "local"})
    out = tmp_path / "out"
    result = CliRunner().invoke(command, ["4242", "--run-root", str(tmp_path), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert answer["png"] == str(out / "report.png") and (out / "report.html").is_file()
    assert answer["summary"]["steps recorded"] == 6
    missing = CliRunner().invoke(command, ["999", "--run-root", str(tmp_path)])
    assert isinstance(missing.exception, RunDirError)


def test_a_long_run_keeps_the_page_small_but_every_evaluated_step(tmp_path):
    run = copy_run("rl", tmp_path)
    first = read_jsonl(run.metrics)[0]
    first.pop("held_out_accuracy", None)
    records = [{**first, "step": s, "t": first["t"] + s} for s in range(1, 1001)]
    records[776]["held_out_accuracy"] = 0.5  # step 777: not a multiple of the thinning stride
    rewrite(run.metrics, records)
    files = write(run)
    page = files.html.read_text()
    table = page.split("<h2>Per-step numbers</h2>")[1]
    shown = table.count("<tr>") - 1
    assert 200 <= shown <= 402 and f"{shown} of 1000 steps shown" in page
    assert "<td>777</td>" in table and "<td>1000</td>" in table
    assert len(page) < 400_000
