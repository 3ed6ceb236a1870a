"""The progress line (rlslurm/progress.py) and what `submit --wait` says of a failed job (rlslurm/launch.py),
on real outputs: tests/data/progress holds the metrics and events of a 4-step tiny-grpo run and a 12-step
tiny-sft run as the jobs wrote them, and the text submitit raised for a job whose rank failed."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from rlslurm.launch import failure_message, root_cause
from rlslurm.progress import LinePrinter, Progress
from rlslurm.rundir import JsonlTail, RunDir, current_names

DATA = Path(__file__).resolve().parents[1] / "data" / "progress"


def _run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.path.mkdir(parents=True)
    return run


def _lines(kind: str, name: str) -> list[str]:
    return (DATA / kind / name).read_text().splitlines(keepends=True)


def test_the_line_of_a_finished_rl_run(tmp_path):
    run = _run(tmp_path)
    for name in ("metrics.jsonl", "events.jsonl"):
        shutil.copy(DATA / "rl" / name, run.path / name)
    progress = Progress(run, total_steps=4)
    line = progress.poll()
    records = [json.loads(m) for m in _lines("rl", "metrics.jsonl")]
    last = records[-1]
    mean_s = sum(r["step_s"] for r in records) / len(records)  # the run's `start` event came before them all
    assert line.startswith(f"step 4/4 100% | {mean_s:.2f} s/step: ")
    assert f"rollout {100 * last['rollout_share']:.0f}% reward {100 * last['reward_share']:.0f}%" in line
    assert "held-out 0.000 (step 4)" in line  # the step-4 evaluation, newer than the start's (an event)
    assert line.endswith(" | done") and "ETA" not in line and progress.finished
    assert progress.poll() is None  # nothing new: nothing to show


def test_a_run_followed_while_it_writes(tmp_path):
    run = _run(tmp_path)
    metrics = _lines("rl", "metrics.jsonl")
    events = [e for e in _lines("rl", "events.jsonl") if json.loads(e)["kind"] != "done"]
    (run.path / "events.jsonl").write_text("".join(events[:2]))
    progress = Progress(run, total_steps=10)
    assert progress.poll() == "no step yet (last event: start)"
    with open(run.metrics, "w") as f:
        f.write(metrics[0] + metrics[1][:40])  # the second record half written
        f.flush()
        first = progress.poll()
        assert first.startswith("step 1/10 10% | ") and "ETA " in first
        f.write(metrics[1][40:])
    second = progress.poll()
    assert second.startswith("step 2/10 20% | ")
    steps_s = [json.loads(m)["step_s"] for m in metrics[:2]]
    assert f"{sum(steps_s) / 2:.2f} s/step" in second  # the mean over the steps seen
    with open(run.path / "events.jsonl", "a") as f:
        f.write(json.dumps({"t": 1.0, "kind": "resume", "checkpoint": "step-00000002", "restart_count": 1}) + "\n")
    assert progress.poll().endswith(" | resumed from step-00000002") and not progress.finished


def test_the_line_of_an_sft_run_and_of_the_toy_job(tmp_path):
    run = _run(tmp_path)
    for name in ("metrics.jsonl", "events.jsonl"):
        shutil.copy(DATA / "sft" / name, run.path / name)
    line = Progress(run, total_steps=12).poll()
    steps = [json.loads(m) for m in _lines("sft", "metrics.jsonl") if '"sft_step"' in m]
    assert line.startswith(f"step 12/12 100% | loss {steps[-1]['loss']:.4f} | lr {steps[-1]['lr']:.2e} | ")
    evaluation = json.loads(_lines("sft", "metrics.jsonl")[-1])  # recorded before issue 39: the old spelling
    assert f"held-out {evaluation['heldout_accuracy']:.3f} (step 12)" in line and line.endswith("| done")

    toy = _run(tmp_path / "toy")
    toy.metrics.write_text("".join(json.dumps({"t": 100.0 + s, "step": s, "loss": 1.0 / s, "restart_count": 1})
                                   + "\n" for s in (1, 2, 3)))
    progress = Progress(toy, total_steps=7)
    assert progress.poll() == "step 3/7 42% | loss 0.3333 | 1.000 s/step | ETA 4s | restart 1"
    # Requeued: 50 s away, back from the step-2 checkpoint at half a second a step. The gap is no step's time.
    (toy.path / "events.jsonl").write_text(json.dumps({"t": 150.0, "kind": "resume", "step": 2,
                                                       "checkpoint": "step-00000002", "restart_count": 2}) + "\n")
    with open(toy.metrics, "a") as f:
        for s, t in ((3, 153.0), (4, 153.5)):
            f.write(json.dumps({"t": t, "step": s, "loss": 1.0 / s, "restart_count": 2}) + "\n")
    assert progress.poll() == ("step 4/7 57% | loss 0.2500 | 0.500 s/step | ETA 2s | restart 2 | "
                               "resumed from step-00000002")


def test_an_sft_runs_held_out_accuracy_reads_under_its_one_name_and_the_old_one(tmp_path):
    # One name per metric (docs/metrics.md): SFT now writes held_out_accuracy as RL does; the recorded run above
    # wrote heldout_accuracy, and both read the same.
    lines = {}
    for spelling in ("old", "new"):
        run = _run(tmp_path / spelling)
        shutil.copy(DATA / "sft" / "events.jsonl", run.path / "events.jsonl")
        records = [json.loads(m) for m in _lines("sft", "metrics.jsonl")]
        if spelling == "new":
            records = [current_names(r) for r in records]
            assert "held_out_accuracy" in records[-1] and not any("heldout" in k for r in records for k in r)
        run.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
        lines[spelling] = Progress(run, total_steps=12).poll()
    assert lines["new"] == lines["old"] and "held-out " in lines["new"]
    assert current_names({"heldout_loss": 0.5, "step": 3}) == {"held_out_loss": 0.5, "step": 3}


def test_a_torn_line_is_skipped_and_a_missing_file_is_empty(tmp_path):
    tail = JsonlTail(tmp_path / "metrics.jsonl")
    assert tail.read() == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2}\n')
    assert tail.read() == [{"step": 2}]
    assert tail.read() == []


def test_printer_rewrites_a_terminal_line_and_throttles_a_log():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    printer = LinePrinter(tty)
    printer.show("step 1")
    printer.show("step 2")
    printer.close()
    assert tty.getvalue() == "\r\033[Kstep 1\r\033[Kstep 2\n"

    now = [0.0]
    log = io.StringIO()
    printer = LinePrinter(log, every_s=10.0, clock=lambda: now[0])
    for t, line in [(0, "step 1"), (3, "step 2"), (6, None), (11, "step 3"), (12, "step 4")]:
        now[0] = t
        printer.show(line)
    printer.show(None, final=True)
    assert log.getvalue() == "step 1\nstep 3\nstep 4\n"


def test_a_failed_job_is_told_by_its_root_cause_and_its_log(tmp_path):
    trace = (DATA / "submitit_failed_job.txt").read_text().replace("RUN_DIR", str(tmp_path))
    cause = root_cause(trace)
    assert cause == ("RlslurmError: train.init_from = '/nonexistent' holds no config.json: point it at an SFT "
                     "export (<sft run>/export/hf)")
    err = tmp_path / "logs" / "submitit" / "5482_0_log.err"
    err.parent.mkdir(parents=True)
    err.write_text("".join(f"line {i}\n" for i in range(20)))
    message = failure_message("5482", tmp_path, trace, tail_lines=3)
    assert message.splitlines()[0] == f"job 5482 failed: {cause}"
    assert f"last lines of {err}:\n    line 17\n    line 18\n    line 19" in message
    assert "rlslurm diag 5482" in message and "Traceback" not in message
    assert root_cause("no error in here") is None


@pytest.mark.parametrize("codes, fails", [([0, 0], False), ([75, 75], True), ([0, 76], True)])
def test_wait_reports_a_job_that_ended_without_finishing(tmp_path, codes, fails):
    from rlslurm.errors import JobFailedError
    from rlslurm.launch import Submission, check_results

    sub = Submission(job_id="7", backend="local", run_dir=tmp_path, job=None)
    if not fails:
        check_results(sub, codes)
        return
    with pytest.raises(JobFailedError, match=r"exit codes .*(DRAINED|HANG_DETECTED).*rlslurm diag 7"):
        check_results(sub, codes)


def test_a_local_job_has_ended_when_no_process_that_beat_since_its_submission_is_alive(tmp_path):
    import os

    import psutil

    from rlslurm.status import job_ended

    run = _run(tmp_path)
    (run.path / "events.jsonl").write_text(json.dumps({"t": 1000.0, "kind": "submitted", "job_id": "7"}) + "\n")
    assert job_ended(run, "7", "local", now=1100.0, since=1000.0) is None  # nothing beat yet: may be starting
    assert job_ended(run, "7", "local", now=1200.0, since=1000.0) == "never started"
    run.heartbeats.mkdir()
    me = {"role": "train", "rank": 0, "pid": os.getpid(), "pid_started": psutil.Process().create_time(),
          "state": "running", "written": 1001.0}
    (run.heartbeats / "train-0.json").write_text(json.dumps(me))
    assert job_ended(run, "7", "local", now=5000.0, since=1000.0) is None  # this very process: alive
    (run.heartbeats / "train-0.json").write_text(json.dumps({**me, "state": "exited"}))
    assert job_ended(run, "7", "local", now=5000.0, since=1000.0) == "exited"
    (run.heartbeats / "train-0.json").write_text(json.dumps({**me, "written": 999.0}))  # an older job's
    assert job_ended(run, "7", "local", now=5000.0, since=1000.0) == "never started"


@pytest.mark.parametrize("requeued, says", [
    (True, "requeued: it resumes by itself"),
    ("SIGTERM", "back only if SLURM requeues it, else `rlslurm resume`"),
    ("not under SLURM", "not requeued: `rlslurm resume` continues it"),
])
def test_a_drained_run_says_who_brings_it_back(tmp_path, requeued, says):
    """A drain's line never reads as a requeue this job did not make (issue 28, case 2)."""
    from rlslurm import events
    from rlslurm.lifecycle import NOT_UNDER_SLURM, SLURM_SIGTERM

    value = {"SIGTERM": SLURM_SIGTERM, "not under SLURM": NOT_UNDER_SLURM}.get(requeued, requeued)
    run = _run(tmp_path)
    events.emit(run, events.DRAINED, step=5, reason="drain requested", signal="SIGTERM", job_id="12",
                checkpoint="step-00000005", requeued=value)
    line = Progress(run).poll()
    assert line.endswith(f"drained at step 5: drain requested ({says})")
