"""Env fingerprints: the real one of this process, planted differences, and the envdiff command."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rlslurm.cli.envdiff import command as envdiff
from rlslurm.diag.env_diff import compare, fingerprint, read_fingerprints, write_fingerprint
from rlslurm.errors import PreflightError
from rlslurm.rundir import RunDir


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    run = RunDir(tmp_path / "run").create()
    for role, rank in (("train", 0), ("train", 1), ("rollout", 0)):
        write_fingerprint(run, role, rank)
    return run


def _plant(run, name, **changes):
    path = run.env / f"{name}.json"
    fp = json.loads(path.read_text())
    fp.update(changes)
    path.write_text(json.dumps(fp))


def test_real_fingerprint_records_what_is_loaded():
    import torch

    fp = fingerprint("train", 0)
    assert fp["torch"] == torch.__version__ and fp["pkg.safetensors"] and fp["python"].count(".") == 2
    assert fp["nccl"] is None and fp["kernel"]  # no CUDA here, so no NCCL was loaded


def test_identical_ranks_agree(run):
    assert compare(read_fingerprints(run.path)).render() == "env-diff: all fingerprints agree\n"


def test_torch_mismatch_between_train_and_rollout_refuses_broadcast_and_names_disk(run):
    _plant(run, "rollout-0", torch="2.12.0+cpu")
    diff = compare(read_fingerprints(run.path), sync_method="broadcast")
    with pytest.raises(PreflightError) as e:
        diff.raise_errors()
    msg = str(e.value)
    assert "torch differs between train and rollout" in msg and "rollout-0: 2.12.0+cpu" in msg
    assert "train-0, train-1: " in msg and "sync.method = 'disk'" in msg and "would work" in msg
    assert compare(read_fingerprints(run.path), sync_method="disk").ok  # a warning only


def test_other_differences_are_warnings_naming_variable_values_and_odd_ranks(run):
    _plant(run, "train-1", **{"env.NCCL_DEBUG": "INFO"})
    diff = compare(read_fingerprints(run.path))
    assert diff.ok
    (w,) = [w for w in diff.warnings if "among the train ranks" in w.message]
    assert "env.NCCL_DEBUG" in w.message and "INFO" in w.message and "WARN" in w.message
    assert w.message.endswith("odd ranks out: train-1")


def test_nccl_mismatch_inside_one_role_is_an_error(run):
    _plant(run, "train-1", nccl="2.21.5")
    assert not compare(read_fingerprints(run.path), sync_method="disk").ok


def test_envdiff_command_on_two_files_and_a_run_dir(run):
    _plant(run, "rollout-0", torch="2.12.0+cpu")
    r = CliRunner().invoke(envdiff, [str(run.env / "train-0.json"), str(run.env / "rollout-0.json")])
    assert r.exit_code == 1 and isinstance(r.exception, PreflightError)  # main.py maps it to exit 3
    assert "torch differs between train and rollout" in str(r.exception)
    r = CliRunner().invoke(envdiff, [str(run.path), "--sync-method", "disk"])
    assert r.exit_code == 0 and "warning: torch differs" in r.output and "3 fingerprints" in r.output


def test_rl_controller_refuses_a_torch_difference_before_a_broadcast_sync(run):
    """rlslurm/rl/controller.py Controller.check_env, the check the RL job runs before its first sync, on planted
    files."""
    from types import SimpleNamespace

    from rlslurm.events import read_events
    from rlslurm.rl.controller import Controller

    _plant(run, "rollout-0", torch="2.12.0+cpu")
    with pytest.raises(PreflightError) as e:
        Controller.check_env(SimpleNamespace(run=run, transport=SimpleNamespace(name="broadcast")))
    assert "torch differs between train and rollout" in str(e.value) and "rollout-0: 2.12.0+cpu" in str(e.value)
    assert "train-0, train-1: " in str(e.value) and "sync.method = 'disk'" in str(e.value)
    (event,) = read_events(run, "env_diff")
    assert event["ok"] is False and "error: torch differs between train and rollout" in event["report"]
    Controller.check_env(SimpleNamespace(run=run, transport=SimpleNamespace(name="disk")))  # a warning only
    assert read_events(run, "env_diff")[-1]["ok"] is True
