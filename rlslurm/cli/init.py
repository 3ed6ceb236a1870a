"""`rlslurm init -o job.yaml`: a starting job config for your cluster, from a few flags (or answers).

    rlslurm init --kind rl --partition-train gpu --partition-rollout gpu --gpu-profile h100-80g \\
        --nodes 2 --gpus-per-node 8 --model-dir /shared/models/my-sft-export -o job.yaml
    rlslurm plan job.yaml && rlslurm submit job.yaml --dry-run

What is not given keeps its default (rlslurm validate job.yaml --print shows them all). With --model-dir, the
model's shape (`model:`, what the planner sizes memory and time from) is read from the directory's HF
config.json. The file is validated by the same loader as `rlslurm validate` before it is written; an existing
file is kept unless --force. A missing required flag is asked for when stdin is a terminal, an error if not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import yaml

from rlslurm.config import JobConfig
from rlslurm.configfile import load_mapping
from rlslurm.errors import ConfigError
from rlslurm.outfile import write_file
from rlslurm.plan.hardware import GPU_PROFILES
from rlslurm.safeyaml import read_text

REQUIRED = {"partition_train": ("--partition-train", str, "SLURM partition of the trainer ranks"),
            "gpu_profile": ("--gpu-profile", click.Choice(sorted(GPU_PROFILES)), "GPU of the nodes"),
            "nodes": ("--nodes", click.IntRange(1, 100_000), "nodes of the job (trainer + rollout)"),
            "gpus_per_node": ("--gpus-per-node", click.IntRange(1, 64), "GPUs per node")}
"""Parameter -> (flag, type, prompt): the answers a config for a cluster cannot guess."""

_HF_SHAPE = {"num_hidden_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
             "num_key_value_heads": "kv_heads", "head_dim": "head_dim", "intermediate_size": "ffn_hidden",
             "vocab_size": "vocab", "max_position_embeddings": "max_positions",
             "tie_word_embeddings": "tie_embeddings"}
"""HF config.json key -> model: key."""


@click.command("init")
@click.option("-o", "--out", type=click.Path(dir_okay=False), default="job.yaml", show_default=True,
              help="Where to write the config.")
@click.option("--kind", type=click.Choice(["rl", "sft"]), default="rl", show_default=True,
              help="rl = GRPO with rollout engines; sft = supervised fine-tuning.")
@click.option("--name", default=None, help="job.name (default: rlslurm-<kind>).")
@click.option("--partition-train", help="cluster.train_partition: partition of the trainer ranks.")
@click.option("--partition-rollout", help="cluster.rollout_partition (default: --partition-train).")
@click.option("--gpu-profile", help=f"hardware.profile, one of: {', '.join(sorted(GPU_PROFILES))}.")
@click.option("--nodes", type=int, help="hardware.nodes: nodes of the job, trainer and rollout together.")
@click.option("--gpus-per-node", type=int, help="hardware.gpus_per_node.")
@click.option("--model-dir", type=click.Path(file_okay=False),
              help="train.init_from: an HF-layout model directory; its config.json sets model:'s shape.")
@click.option("--time-limit-min", type=int, help="cluster.time_limit_min: one allocation's wall clock.")
@click.option("--account", help="SLURM account (cluster.extra_sbatch: --account=...).")
@click.option("--run-root", help="cluster.run_root: run directories on the shared filesystem.")
@click.option("--steps", type=int, help="train.steps.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def command(out: str, kind: str, name: str | None, force: bool, **given) -> None:
    """Write a starting job config for your cluster to OUT (validated; see `rlslurm validate --print`)."""
    path = Path(out)
    if (path.exists() or path.is_symlink()) and not force:  # before the questions; write_file checks it again
        raise click.UsageError(f"{out} exists" + (" (a symbolic link)" if path.is_symlink() else "")
                               + "; pass --force to replace it")
    answers = _complete(given)
    data = job_mapping(kind=kind, name=name or f"rlslurm-{kind}", **answers)
    text = (f"# Written by `rlslurm init`. Check it: rlslurm plan {out}; rlslurm submit {out} --dry-run\n"
            "# Every key and its default: rlslurm validate " f"{out} --print\n"
            + yaml.safe_dump(data, sort_keys=False))
    job = load_mapping(JobConfig, read_text(text, out), source=out)  # what `rlslurm validate` would say
    write_file(path, text, replace=force)  # created anew, or renamed over: never written through a link
    click.echo(f"{out}: written ({job.job.kind} job {job.job.name!r}, {job.hardware.nodes} node(s) x "
               f"{job.hardware.gpus_per_node} {job.hardware.profile}); next: rlslurm plan {out}")


def interactive() -> bool:
    """Whether missing answers may be asked: stdin is a terminal (a batch script or CI gets an error instead)."""
    return sys.stdin.isatty()


def _complete(given: dict) -> dict:
    """The flags, with each missing required one asked for on a terminal; a UsageError naming them if not."""
    missing = [key for key in REQUIRED if given.get(key) is None]
    if missing and not interactive():
        raise click.UsageError("missing " + ", ".join(REQUIRED[k][0] for k in missing)
                               + " (asked interactively only when stdin is a terminal)")
    for key in missing:
        flag, kind, prompt = REQUIRED[key]
        given[key] = click.prompt(f"{prompt} ({flag})", type=kind)
    return given


def job_mapping(*, kind: str, name: str, partition_train: str, gpu_profile: str, nodes: int, gpus_per_node: int,
                partition_rollout: str | None = None, model_dir: str | None = None,
                time_limit_min: int | None = None, account: str | None = None, run_root: str | None = None,
                steps: int | None = None) -> dict:
    """The job YAML's mapping for these answers: only the keys they set (the rest keeps its default)."""
    cluster: dict = {"backend": "slurm", "train_partition": partition_train,
                     "rollout_partition": partition_rollout or partition_train}
    if time_limit_min is not None:
        cluster["time_limit_min"] = time_limit_min
    if account is not None:
        cluster["extra_sbatch"] = [f"--account={account}"]
    if run_root is not None:
        cluster["run_root"] = run_root
    data: dict = {"job": {"name": name, "kind": kind}, "cluster": cluster,
                  "hardware": {"profile": gpu_profile, "nodes": nodes, "gpus_per_node": gpus_per_node}}
    train: dict = {}
    if model_dir is not None:
        data["model"] = model_shape(Path(model_dir))
        train["init_from"] = model_dir
    if steps is not None:
        train["steps"] = steps
    if train:
        data["train"] = train
    return data


def model_shape(model_dir: Path) -> dict:
    """`model:` from an HF-layout directory's config.json (Llama / Qwen / SmolLM style keys)."""
    config = model_dir / "config.json"
    try:
        hf = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model-dir {model_dir}: cannot read {config} ({type(e).__name__}: {e}); point it "
                          "at an HF-layout model directory (config.json, model.safetensors, tokenizer files)") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"--model-dir {model_dir}: {config} is not a JSON object")
    shape = {"name": model_dir.resolve().name[:128]}
    shape.update({ours: hf[theirs] for theirs, ours in _HF_SHAPE.items() if hf.get(theirs) is not None})
    return shape
