"""`logging:` (rlslurm/metrics_sinks.py): the config's keys and its missing-package error at validate and submit,
metrics.jsonl written before any sink, a failing sink warned about once, and real TensorBoard event files."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlslurm import metrics_sinks
from rlslurm.cli.main import cli
from rlslurm.config import load_config
from rlslurm.errors import ConfigError
from rlslurm.metrics_sinks import LoggingConfig, MetricsLog, numeric
from rlslurm.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "tiny-grpo.yaml")


def test_off_by_default_and_unknown_keys_list_the_valid_ones():
    assert load_config(EXAMPLE).logging == LoggingConfig(tensorboard=False, wandb=False)
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, ("logging.tensorbord=true",))
    assert "logging.tensorbord is not a key of logging" in str(err.value)
    assert "Did you mean 'tensorboard'" in str(err.value) and "wandb_project (default 'rlslurm')" in str(err.value)


@pytest.mark.parametrize("key,package,fix", [("tensorboard", "tensorboard", "pip install 'rlslurm[logging]'"),
                                             ("wandb", "wandb", "pip install wandb")])
@pytest.mark.parametrize("command", [["validate"], ["submit", "--dry-run"]])
def test_a_missing_package_is_an_error_at_validate_and_submit(monkeypatch, key, package, fix, command):
    # Simulates an environment without the package; the check itself is importlib's find_spec.
    monkeypatch.setattr(metrics_sinks, "installed", lambda module: module != package)
    result = CliRunner().invoke(cli, [*command, EXAMPLE, "--set", f"logging.{key}=true"])
    assert result.exit_code != 0
    assert f"logging.{key} = True needs the {package} package" in result.output, result.output
    assert fix in result.output and "Traceback" not in result.output


def test_installed_asks_importlib():
    assert metrics_sinks.installed("tensorboard")
    assert not metrics_sinks.installed("no_such_package_rlslurm")


def test_numeric_fields_only_without_the_axes():
    record = {"t": 1.0, "step": 3, "kind": "sft_step", "loss": 0.5, "samples": 8, "sync_skipped": True,
              "nan": float("nan"), "nested": {"a": 1}}
    assert numeric(record) == {"loss": 0.5, "samples": 8.0}


def test_tensorboard_sink_writes_what_metrics_jsonl_holds(tmp_path):
    run = RunDir(tmp_path / "run").create()
    metrics = MetricsLog(run, LoggingConfig(tensorboard=True))
    for step in (1, 2, 3):
        metrics.append({"t": 1000.0 + step, "step": step, "reward_mean": step / 10, "kind": "rl"})
    metrics.close()
    assert [r["reward_mean"] for r in read_jsonl(run.metrics)] == [0.1, 0.2, 0.3]
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward_mean"]
    assert [(e.step, round(e.value, 6), e.wall_time) for e in events.Scalars("reward_mean")] == [
        (1, 0.1, 1001.0), (2, 0.2, 1002.0), (3, 0.3, 1003.0)]


def test_a_resumed_job_replaces_the_steps_it_makes_again(tmp_path):
    run = RunDir(tmp_path / "run").create()
    first = MetricsLog(run, LoggingConfig(tensorboard=True))
    for step in (1, 2, 3, 4):  # killed after step 4; its newest checkpoint is step 2
        first.append({"t": 1000.0 + step, "step": step, "loss": 1.0})
    first.close()
    resumed = MetricsLog(run, LoggingConfig(tensorboard=True))
    for step in (3, 4, 5):
        resumed.append({"t": 2000.0 + step, "step": step, "loss": 0.5})
    resumed.close()
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 1.0), (3, 0.5), (4, 0.5), (5, 0.5)]


def test_a_failing_sink_is_warned_about_once_and_never_fails_the_step(tmp_path, monkeypatch, caplog):
    calls = []

    class Broken:
        def __init__(self, run, config, first_step):
            pass

        def write(self, step, values, wall_time):
            calls.append(step)
            raise OSError("No space left on device")

        def close(self):
            raise AssertionError("a dropped sink is not closed")

    monkeypatch.setitem(metrics_sinks.SINKS, "tensorboard", Broken)
    run = RunDir(tmp_path / "run").create()
    metrics = MetricsLog(run, LoggingConfig(tensorboard=True))
    with caplog.at_level(logging.WARNING, logger="rlslurm.metrics_sinks"):
        for step in (1, 2, 3):
            metrics.append({"t": 0.0, "step": step, "loss": 1.0})
        metrics.close()
    assert calls == [1]
    assert [r["step"] for r in read_jsonl(run.metrics)] == [1, 2, 3]
    (warning,) = caplog.records
    assert "logging.tensorboard: OSError: No space left on device" in warning.getMessage()


def test_a_sink_that_cannot_start_is_dropped_too(tmp_path, monkeypatch, caplog):
    def refuse(run, config, first_step):
        raise RuntimeError("cannot create the writer")

    monkeypatch.setitem(metrics_sinks.SINKS, "wandb", refuse)
    monkeypatch.setattr(metrics_sinks, "installed", lambda module: True)
    run = RunDir(tmp_path / "run").create()
    metrics = MetricsLog(run, LoggingConfig(wandb=True))
    with caplog.at_level(logging.WARNING, logger="rlslurm.metrics_sinks"):
        metrics.append({"step": 1, "loss": 1.0})
        metrics.append({"step": 2, "loss": 0.5})
    assert len(caplog.records) == 1 and "logging.wandb: RuntimeError" in caplog.records[0].getMessage()
    assert len(read_jsonl(run.metrics)) == 2


def test_logging_keys_a_job_would_ignore_are_errors():
    with pytest.raises(ConfigError, match="logging.wandb_project = 'mine' is ignored with logging.wandb = false"):
        load_config(EXAMPLE, ("logging.wandb_project=mine",))
    with pytest.raises(ConfigError, match="logging.tensorboard = True is ignored with job.kind = 'toy'"):
        load_config(EXAMPLE, ("job.kind=toy", "logging.tensorboard=true"))
