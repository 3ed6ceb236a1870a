"""SFT on a user's own files, end to end through `rlslurm submit --backend local --wait`: the two examples
(TRL prompt/completion jsonl; TRL chat messages through the embedded model's chat template) run to done and
learn; the chat form trains exactly as the text form it renders to (the loss is on the assistant turn only);
rows past model.max_positions are counted, never silently kept or lost; a resumed run continues at the data
position its checkpoint saved, as a run that never stopped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm.checkpoint import latest_complete
from rlslurm.events import read_events
from rlslurm.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlslurm.cli.main", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=ROOT)


def _submit(example: str, run_root: Path, *sets: str) -> RunDir:
    args = ["submit", str(ROOT / "examples" / example), "--backend", "local", "--run-root", str(run_root), "--wait"]
    for item in sets:
        args += ["--set", item]
    done = _cli(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return RunDir(Path(re.search(r"run directory: (\S+)", done.stdout).group(1)))


def _losses(run: RunDir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run.metrics) if r["kind"] == "sft_step"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, RunDir]:
    root = tmp_path_factory.mktemp("sft-data")
    return {"jsonl": _submit("sft-jsonl.yaml", root), "chat": _submit("sft-chat.yaml", root)}


def test_both_examples_run_to_done_and_learn(runs):
    for name, run in runs.items():
        (finished,) = read_events(run, "sft_finished")
        losses = _losses(run)
        assert sorted(losses) == list(range(1, 41)) and finished["step"] == 40, name
        first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(36, 41)) / 5
        assert last < 0.6 * first, (name, first, last)
        (record,) = [r for r in read_jsonl(run.metrics) if r["kind"] == "sft_eval"]
        assert record["held_out_rows"] == 10 and record["held_out_loss"] < first, (name, record)
        assert (run.path / "export" / "hf" / "model.safetensors").exists()


def test_chat_messages_train_exactly_as_the_text_they_render_to(runs):
    # "<s>7*8=" + "56</s>": the embedded chat template renders a user turn as the plain prompt, and only the
    # assistant's tokens are learned in both, so the two runs are the same computation, bit for bit.
    assert _losses(runs["chat"]) == _losses(runs["jsonl"])


def test_rows_past_the_model_length_are_counted(tmp_path):
    # max_positions 7: "<s>9*9=81</s>" (8 tokens) is cut to "<s>9*9=81" (truncate); one-digit products fit.
    run = _submit("sft-jsonl.yaml", tmp_path, "model.max_positions=7", "data.too_long=truncate",
                  "rollout.max_new_tokens=2", "train.steps=10")
    skipped = read_events(run, "data_rows_skipped")
    steps = [r for r in read_jsonl(run.metrics) if r["kind"] == "sft_step"]
    # every step's row counts (zeros too: one key set per row, docs/metrics.md); the steps that skipped, an event
    assert len(skipped) == sum(1 for r in steps if any(r["rows_skipped"].values())) > 0
    assert all(e["truncated"] > 0 and e["too_long"] == 0 for e in skipped)
    # drop is refused before submit: validate reads the rows and names the first too-long one
    refused = _cli("validate", str(ROOT / "examples" / "sft-jsonl.yaml"), "--set", "model.max_positions=7",
                   "--set", "rollout.max_new_tokens=2")
    assert refused.returncode == 2 and "is too long: prompt + completion + </s> is 8 tokens" in refused.stderr


def test_a_resumed_run_continues_at_its_saved_data_position(runs, tmp_path):
    first = _submit("sft-jsonl.yaml", tmp_path, "train.steps=20")
    ckpt = latest_complete(first)
    assert ckpt.load_json("trainer")["data"] == {"epoch": 20 * 16 // 90, "index": 20 * 16 % 90, "rows": 90,
                                                 "seed": 0, "drawn": 20 * 16, "bad": 0}
    events_before = (first.path / "events.jsonl").read_text()
    refused = _cli("resume", str(first.path), "--set", "train.steps=40", "--set", "data.train=nope.jsonl")
    assert refused.returncode == 2 and "data.train = 'nope.jsonl': no such file or directory" in refused.stderr
    assert (first.path / "events.jsonl").read_text() == events_before, "a refused resume changed the run"
    resumed = _cli("resume", str(first.path), "--set", "train.steps=40", "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    losses, straight = _losses(first), _losses(runs["jsonl"])
    assert sorted(losses) == list(range(1, 41))
    assert losses == straight, "the resumed run drew other rows (or other weights) than the uninterrupted one"


def test_bad_rows_are_counted_and_past_the_share_the_run_stops_naming_the_last(tmp_path):
    # rows 8, 12, ... lose their completion: past data.check_rows = 5, so only a step finds them
    rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "mul-prompt-completion.jsonl").open()]
    for i in range(8, len(rows), 4):
        rows[i]["completion"] = None
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counted = _submit("sft-jsonl.yaml", tmp_path, f"data.train={data}", "data.check_rows=5", "train.steps=6",
                      "data.max_bad_share=1")
    skipped = [r["rows_skipped"]["bad_rows"] for r in read_jsonl(counted.metrics)
               if r["kind"] == "sft_step" and any(r["rows_skipped"].values())]
    assert skipped and all(n > 0 for n in skipped)
    done = _cli("submit", str(ROOT / "examples" / "sft-jsonl.yaml"), "--backend", "local", "--run-root",
                str(tmp_path), "--wait", "--set", f"data.train={data}", "--set", "data.check_rows=5", "--set",
                "train.steps=6", "--set", "data.max_bad_share=0.05")
    assert done.returncode != 0
    stopped = RunDir(Path(re.search(r"run directory: (\S+)", done.stdout).group(1)))
    errors = [e["error"] for e in read_events(stopped, "phase_failed")]
    assert any("BadRowShareError" in e and "past data.max_bad_share = 0.05; the last: data.train = " in e
               and "column 'completion'" in e for e in errors), errors
