"""The job config: strict loading, messages that name the key and the fix, non-zero exit, nothing submitted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlslurm.cli.main import cli
from rlslurm.config import JobConfig, load_config
from rlslurm.configfile import field_docs, to_dict
from rlslurm.errors import ConfigError

# (YAML text, fragments the one-line error must contain). Each is a mistake a user makes.
MALFORMED = [
    ("rl: {samples_per_promt: 4}\n", ["rl.samples_per_promt", "Did you mean 'samples_per_prompt'", "Valid keys"]),
    ("job: {name: x}\nbogus_section: {}\n", ["bogus_section", "is not a key of the top level", "cluster"]),
    ("rl: {prompts_per_step: many}\n", ["rl.prompts_per_step", "must be an integer"]),
    ("train: {lr: fast}\n", ["train.lr", "must be a number"]),
    ("hardware: {nodes: -1}\n", ["hardware.nodes", "= -1", "must be >= 1"]),
    ("hardware: {gpus_per_node: 0}\n", ["hardware.gpus_per_node", "must be >= 1"]),
    ("hardware: {profile: h99-1t}\n", ["hardware.profile", "known: h20-96g"]),
    ("parallel: {tp: 4}\nhardware: {gpus_per_node: 2}\n", ["parallel.tp = 4", "hardware.gpus_per_node = 2"]),
    ("model: {experts: 8, topk: 2}\nparallel: {ep: 2}\nhardware: {nodes: 3, gpus_per_node: 1}\n"
     "placement: {mode: colocate}\n", ["parallel.ep = 2 does not divide DP = 3"]),
    ("model: {layers: 3}\nparallel: {pp: 2}\n", ["parallel.pp = 2 does not divide model.layers = 3"]),
    ("model: {hidden: 64, heads: 5}\n", ["model.heads", "must divide model.hidden = 64"]),
    ("cluster: {train_partition: ''}\n", ["cluster.train_partition", "must not be empty"]),
    ("reward: {service: component}\n", ["reward.partition", "is required when reward.service = 'component'"]),
    ("diag: {hang_timeout_s: 0}\n", ["diag.hang_timeout_s = 0", "must be > 0", "seconds without progress"]),
    ("rl: {samples_per_prompt: 1}\n", ["rl.samples_per_prompt", "must be >= 2"]),
    ("sync: {method: carrier-pigeon}\n", ["sync.method", "must be one of 'auto', 'disk', 'broadcast', 'ipc'"]),
    ("job: {kind: dpo}\n", ["job.kind", "'sft', 'rl', 'toy'"]),
    ("rl: [1, 2]\n", ["rl must be a mapping", "samples_per_prompt"]),
    ("rl: {clip_eps: 0.2\n", ["invalid YAML at line"]),
    ("- just\n- a list\n", ["top level must be a mapping"]),
    ("placement: {rollout_nodes: 2}\nhardware: {nodes: 2}\n", ["placement.rollout_nodes", "at least one node"]),
    ("cluster: {time_limit_min: 1, signal_before_s: 90}\n",
     ["cluster.signal_before_s", "less than cluster.time_limit_min x 60 = 60"]),
    ("diag: {phase_timeouts_s: {train: -5}}\n", ["diag.phase_timeouts_s.train", "must be > 0"]),
    ("reward: {scorer: judge}\n", ["reward.endpoint", "is required when reward.scorer = 'judge'"]),
    ("rollout: {tp: 4}\nhardware: {gpus_per_node: 2}\n", ["rollout.tp", "hardware.gpus_per_node = 2"]),
    ("task: {train_size: true}\n", ["task.train_size", "must be an integer"]),
]


@pytest.mark.parametrize("text,fragments", MALFORMED, ids=[f"bad{i:02d}" for i in range(len(MALFORMED))])
def test_malformed_config_is_refused_with_the_key(tmp_path: Path, text: str, fragments: list[str]):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message, "one line per error"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("text,fragments", MALFORMED[:6], ids=[f"cli{i}" for i in range(6)])
def test_cli_exits_nonzero_with_one_line(tmp_path: Path, text: str, fragments: list[str]):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == ConfigError.exit_code
    assert "Traceback" not in result.output
    assert fragments[0] in result.output


def test_debug_shows_the_traceback(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text(MALFORMED[0][0])
    result = CliRunner().invoke(cli, ["--debug", "validate", str(path)])
    assert isinstance(result.exception, ConfigError)


def test_missing_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n", "---\n...\n"])
def test_empty_file_holds_no_job(tmp_path: Path, text: str):
    # Was: an empty file gave a job of all defaults (issue 15: "an empty file accepted as a job").
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="holds no job: the file is empty"):
        load_config(path)


def test_resolved_config_round_trips(tmp_path: Path):
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text("rl: {samples_per_prompt: 4}\ndiag: {phase_timeouts_s: {rollout: 30}}\n")
    job = load_config(path)
    again = tmp_path / "resolved.yaml"
    again.write_text(yaml.safe_dump(to_dict(job)))
    assert load_config(again) == job
    assert job.rl.samples_per_prompt == 4 and job.diag.phase_timeouts_s == {"rollout": 30.0}


def _all_config_classes(cls=JobConfig, seen=None):
    seen = seen if seen is not None else []
    seen.append(cls)
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            _all_config_classes(f.default_factory, seen)
    return seen


def test_every_config_field_is_documented_and_classes_are_frozen():
    for cls in _all_config_classes():
        params = cls.__dataclass_params__
        assert params.frozen, f"{cls.__name__} must be frozen"
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__module__}.{cls.__name__}: fields without a docstring: {missing}"


def test_example_configs_load():
    examples = sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml"))
    for path in examples:
        load_config(path)


def test_scientific_notation_without_a_dot_is_a_number(tmp_path: Path):
    # PyYAML (YAML 1.1) reads 1e-5 as a string; users write it that way, and --set passes it so.
    path = tmp_path / "job.yaml"
    path.write_text("train: {lr: 1e-5}\n")
    assert load_config(path).train.lr == 1e-5
    assert load_config(path, ["train.lr=3e-4"]).train.lr == 3e-4


def test_set_overrides_are_validated_like_the_file(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("rl: {samples_per_prompt: 4}\n")
    assert load_config(path, ["rl.samples_per_prompt=16", "job.name=x"]).rl.samples_per_prompt == 16
    with pytest.raises(ConfigError, match="rl.samples_per_prompt = 1 must be >= 2"):
        load_config(path, ["rl.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(path, ["rl.samples_per_prompt"])
