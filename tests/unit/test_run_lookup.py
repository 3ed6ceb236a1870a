"""One run lookup for every `<jobid|rundir>` argument (rlslurm/rundir.py find_run): each rule on run
directories laid out as submit, the job's starts and its tasks write them, and every CLI command using it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlslurm.cli.main import cli
from rlslurm.errors import RunDirError
from rlslurm.rundir import RunDir, find_run, newest_job_id

DATA = Path(__file__).parent.parent / "data"


def make_run(root: Path, name: str, *, submitted: list[tuple[float, str]] = (), started: list[tuple[float, str]] = (),
             placed: list[tuple[float, str, str]] = ()) -> RunDir:
    """A run directory with submissions (t, job id), starts (t, leader id) and placements (t, leader, own id)."""
    run = RunDir(root / name).create()
    run.config.write_text("job: {name: x}\n")
    for t, job_id in submitted:
        run.append_json(run.path / "submissions.jsonl", {"t": t, "job_id": job_id, "backend": "slurm"})
    for t, job_id in started:
        run.append_json(run.jobs, {"t": t, "job_id": job_id, "restart_count": 0, "step": 0})
    for t, leader, own in placed:
        run.append_json(run.path / "placement.jsonl",
                        {"t": t, "role": "rollout", "job_id": leader, "slurm_job_id": own})
    return run


def test_a_run_directory_is_that_run_with_its_newest_job(tmp_path):
    run = make_run(tmp_path, "a", submitted=[(1.0, "12")], started=[(2.0, "12"), (3.0, "12")])
    run.record_start(resubmitted=True, after_job_id="12", step=None)  # a resume: no job id of its own
    run.append_json(run.path / "submissions.jsonl", {"t": 9e12, "job_id": "20", "backend": "slurm"})
    assert find_run(run.path) == (run, "20")
    assert find_run(str(run.path) + "/", run_root=tmp_path / "elsewhere").run.path == run.path


def test_a_run_directory_without_any_job_has_none_and_a_config_less_one_is_still_a_run(tmp_path):
    never = make_run(tmp_path, "never")
    assert find_run(never.path) == (never, None)
    early = RunDir(tmp_path / "early").create()  # killed before its config was written: its events say why
    early.append_json(early.events, {"t": 1.0, "kind": "submitted"})
    assert find_run(early.path).run == early


def test_a_directory_that_is_no_run_names_the_runs_inside_it(tmp_path):
    make_run(tmp_path, "tiny-grpo-20260101-000001")
    with pytest.raises(RunDirError, match=r"not a run directory .*runs in it: tiny-grpo-20260101-000001"):
        find_run(tmp_path)


def test_a_job_id_is_found_across_requeues_and_resumes(tmp_path):
    make_run(tmp_path, "other", submitted=[(1.0, "7")], started=[(2.0, "7")])
    run = make_run(tmp_path, "requeued", submitted=[(10.0, "12"), (50.0, "20")],
                   started=[(11.0, "12"), (20.0, "12"), (30.0, "12"), (51.0, "20")])
    assert find_run("12", run_root=tmp_path) == (run, "12")
    assert find_run("20", run_root=tmp_path) == (run, "20")


def test_a_job_that_never_started_is_found_by_its_submission(tmp_path):
    run = make_run(tmp_path, "pending", submitted=[(1.0, "33")])
    assert find_run("33", run_root=tmp_path) == (run, "33")


def test_a_het_component_is_found_by_offset_or_own_id_and_answers_with_the_leader(tmp_path):
    run = make_run(tmp_path, "het", submitted=[(1.0, "12")], started=[(2.0, "12")],
                   placed=[(2.0, "12", "12"), (2.5, "12", "13")])
    assert find_run("12+1", run_root=tmp_path) == (run, "12")
    assert find_run("12+0", run_root=tmp_path) == (run, "12")
    assert find_run("13", run_root=tmp_path) == (run, "12")


def test_a_reused_job_id_finds_the_newest_run(tmp_path):
    make_run(tmp_path, "b-old", submitted=[(100.0, "5")], started=[(101.0, "5")])
    new = make_run(tmp_path, "a-new", submitted=[(200.0, "5")])
    assert find_run("5", run_root=tmp_path).run == new


def test_default_roots_are_runs_then_here_and_a_name_under_a_root_is_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    in_runs = make_run(tmp_path / "runs", "r1", submitted=[(1.0, "41")])
    here = make_run(tmp_path, "r2", submitted=[(1.0, "42")])
    assert find_run("41").run.path.resolve() == in_runs.path.resolve()
    assert find_run("42").run.path.resolve() == here.path.resolve()
    assert find_run("r1").run.path.resolve() == in_runs.path.resolve()


def test_not_found_says_where_it_looked(tmp_path):
    make_run(tmp_path, "r", submitted=[(1.0, "1")])
    with pytest.raises(RunDirError) as err:
        find_run("999", run_root=tmp_path)
    text = str(err.value)
    assert "no run records job 999" in text and f"{tmp_path.resolve()} (1 run directory)" in text
    assert "submissions.jsonl,jobs.jsonl,placement.jsonl" in text and "--run-root" in text
    with pytest.raises(RunDirError, match=r"'no/such/run' is no directory, job id or run name: looked in"):
        find_run("no/such/run", run_root=tmp_path)


def test_newest_job_id_of_records_without_times_is_the_last_one(tmp_path):
    run = make_run(tmp_path, "untimed")
    for job_id in ("4242", "4243"):
        run.append_json(run.path / "submissions.jsonl", {"job_id": job_id, "backend": "local"})
    assert newest_job_id(run) == "4243"


def _laid_out(tmp_path: Path) -> RunDir:
    """A recorded local RL run (metrics, events, env fingerprints) as het job 12, component 13 placed."""
    run = RunDir(tmp_path / "runs" / "rl-20260101-000000")
    shutil.copytree(DATA / "report" / "rl", run.path)
    run.create()
    shutil.copy(DATA / "gpu_smoke" / "run" / "env" / "train-0.json", run.env / "train-0.json")
    run.append_json(run.path / "submissions.jsonl", {"t": 1.0, "job_id": "12", "backend": "local"})
    run.append_json(run.path / "placement.jsonl", {"t": 2.0, "role": "rollout", "job_id": "12", "slurm_job_id": "13"})
    return run


@pytest.mark.parametrize("argv", [
    ["status", "{id}"], ["report", "{id}", "--json"], ["drain", "{id}"], ["envdiff", "{id}"],
    ["diag", "{id}", "--no-slurm", "--no-live", "--out", "{out}"],
])
def test_every_command_finds_the_run_the_same_way(tmp_path, argv):
    run = _laid_out(tmp_path)
    runner = CliRunner()
    for job in ("12", "12+1", "13", str(run.path)):
        args = [a.format(id=job, out=tmp_path / "out") for a in argv]
        result = runner.invoke(cli, [*args, "--run-root", str(run.path.parent)], catch_exceptions=False)
        assert result.exit_code == 0, (job, result.output)
    missing = runner.invoke(cli, [argv[0], "999", "--run-root", str(run.path.parent)])
    assert missing.exit_code == RunDirError.exit_code and "no run records job 999: looked in" in missing.output


def test_resume_finds_the_run_the_same_way(tmp_path):
    _laid_out(tmp_path)
    result = CliRunner().invoke(cli, ["resume", "999", "--run-root", str(tmp_path / "runs")])
    assert result.exit_code == RunDirError.exit_code and "no run records job 999: looked in" in result.output
