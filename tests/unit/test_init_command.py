"""`rlslurm init`: a starting config from flags, validated by `rlslurm validate`'s loader before it is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlslurm.cli.main import cli
from rlslurm.config import load_config

CLUSTER = ["--partition-train", "gpu-a", "--partition-rollout", "gpu-b", "--gpu-profile", "h100-80g",
           "--nodes", "3", "--gpus-per-node", "8"]


def _init(tmp_path: Path, *args: str):
    return CliRunner().invoke(cli, ["init", "-o", str(tmp_path / "job.yaml"), *args])


def test_flags_land_in_their_keys_and_the_file_validates(tmp_path):
    result = _init(tmp_path, *CLUSTER, "--kind", "rl", "--name", "my-grpo", "--time-limit-min", "240",
                   "--account", "ml-team", "--run-root", "/shared/runs", "--steps", "500")
    assert result.exit_code == 0, result.output
    out = tmp_path / "job.yaml"
    assert f"{out}: written (rl job 'my-grpo', 3 node(s) x 8 h100-80g)" in result.output
    job = load_config(out)  # the same loader as `rlslurm validate`
    assert (job.cluster.backend, job.cluster.train_partition, job.cluster.rollout_partition) == ("slurm", "gpu-a",
                                                                                                  "gpu-b")
    assert (job.hardware.profile, job.hardware.nodes, job.hardware.gpus_per_node) == ("h100-80g", 3, 8)
    assert (job.job.kind, job.job.name, job.train.steps) == ("rl", "my-grpo", 500)
    assert job.cluster.time_limit_min == 240 and job.cluster.extra_sbatch == ["--account=ml-team"]
    assert job.cluster.run_root == "/shared/runs"
    validate = CliRunner().invoke(cli, ["validate", str(out)])
    assert validate.exit_code == 0 and "ok (rl job 'my-grpo')" in validate.output


def test_model_dir_sets_init_from_and_the_shape_from_config_json(tmp_path):
    model = tmp_path / "smol"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "model_type": "llama"}))
    result = _init(tmp_path, *CLUSTER, "--kind", "sft", "--model-dir", str(model))
    assert result.exit_code == 0, result.output
    job = load_config(tmp_path / "job.yaml")
    assert job.train.init_from == str(model) and job.job.kind == "sft"
    m = job.model
    assert (m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.max_positions) == (
        "smol", 30, 576, 9, 3, 1536, 49152, 8192)
    assert job.cluster.rollout_partition == "gpu-b"


def test_a_real_export_directory_round_trips(tmp_path):
    from rlslurm.config import JobConfig
    from rlslurm.tinymodel import build_model, save_hf

    save_hf(build_model(JobConfig().model, seed=0), tmp_path / "export")
    result = _init(tmp_path, *CLUSTER, "--model-dir", str(tmp_path / "export"))
    assert result.exit_code == 0, result.output
    assert load_config(tmp_path / "job.yaml").model.hidden == JobConfig().model.hidden


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "job.yaml"
    out.write_text("keep me\n")
    result = _init(tmp_path, *CLUSTER)
    assert result.exit_code == 2 and "exists; pass --force" in result.output
    assert out.read_text() == "keep me\n"
    assert _init(tmp_path, *CLUSTER, "--force").exit_code == 0
    assert yaml.safe_load(out.read_text())["cluster"]["train_partition"] == "gpu-a"


def test_missing_answers_without_a_terminal_are_named(tmp_path):
    result = _init(tmp_path, "--partition-train", "gpu")  # CliRunner's stdin is not a terminal
    assert result.exit_code == 2
    assert "missing --gpu-profile, --nodes, --gpus-per-node" in result.output
    assert not (tmp_path / "job.yaml").exists()


def test_missing_answers_on_a_terminal_are_asked(tmp_path, monkeypatch):
    monkeypatch.setattr("rlslurm.cli.init.interactive", lambda: True)  # CliRunner's stdin is a pipe
    result = CliRunner().invoke(cli, ["init", "-o", str(tmp_path / "job.yaml"), "--partition-train", "gpu"],
                                input="a100-80g\n2\n4\n")
    assert result.exit_code == 0, result.output
    job = load_config(tmp_path / "job.yaml")
    assert (job.hardware.profile, job.hardware.nodes, job.hardware.gpus_per_node) == ("a100-80g", 2, 4)


def test_an_invalid_answer_writes_nothing(tmp_path):
    result = _init(tmp_path, "--partition-train", "bad partition!", "--gpu-profile", "h100-80g", "--nodes", "2",
                   "--gpus-per-node", "8")
    assert result.exit_code != 0 and "cluster.train_partition" in result.output
    assert not (tmp_path / "job.yaml").exists()
    bad_dir = _init(tmp_path, *CLUSTER, "--model-dir", str(tmp_path / "nowhere"))
    assert bad_dir.exit_code != 0 and "--model-dir" in bad_dir.output and "config.json" in bad_dir.output


def test_a_planted_link_is_never_written_through(tmp_path):
    """Issue 37: `init -o job.yaml` followed a dangling link planted at the name (writing its target), and
    `--force` wrote through any link. Now the file is created anew (O_EXCL | O_NOFOLLOW) and --force renames a new
    file over the name: the link is replaced, its target untouched."""
    target = tmp_path / "victim"
    (tmp_path / "job.yaml").symlink_to(target)  # dangling: exists() is False
    refused = _init(tmp_path, *CLUSTER)
    assert refused.exit_code == 2 and "a symbolic link" in refused.output, refused.output
    assert not target.exists()
    target.write_text("precious\n")
    forced = _init(tmp_path, *CLUSTER, "--force")
    assert forced.exit_code == 0, forced.output
    assert target.read_text() == "precious\n"
    assert not (tmp_path / "job.yaml").is_symlink() and load_config(tmp_path / "job.yaml").hardware.nodes == 3


def test_the_clis_other_outputs_replace_a_link_instead_of_writing_through_it(tmp_path):
    from rlslurm.data.humaneval import write_jsonl
    from rlslurm.errors import OutputFileError
    from rlslurm.outfile import replacing, write_file

    target = tmp_path / "victim"
    target.write_text("precious\n")
    for name in ("out.jsonl", "bundle.tar.gz"):
        (tmp_path / name).symlink_to(target)
    write_jsonl(tmp_path / "out.jsonl", [{"row": 0}])  # score --out and humaneval --out: replace=True
    with replacing(tmp_path / "bundle.tar.gz") as f:  # the diag bundle
        f.write(b"gz")
    assert target.read_text() == "precious\n"
    assert (tmp_path / "out.jsonl").read_text() == '{"row": 0}\n' and (tmp_path / "bundle.tar.gz").read_bytes() == b"gz"
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OutputFileError, match="a symbolic link"):
        write_file(tmp_path / "link", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle.tar.gz", "link", "out.jsonl", "victim"]  # no temp
