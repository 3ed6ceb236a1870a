"""What of the GPU path (issue 7) can be checked without a GPU: train.backend = megatron's config rules, the
checkpoint-to-Megatron shape reading, the policy's optimizer shards around
real torch optimizers, the smoke job's config and plan, the smoke script's syntax, and bench/gpu_smoke.py's
report on a hand-made run directory (tests/data/gpu_smoke).

    python -m pytest -q tests/unit/test_gpu_backend.py      # ~5 s
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlslurm.config import JobConfig, load_config
from rlslurm.errors import ConfigError, RlslurmError

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "gpu_smoke" / "run"


def _load(tmp_path, text: str) -> JobConfig:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("text, fragments", [
    ("job: {kind: toy}\n", ["train.backend = 'megatron'", "job.kind = 'rl' and 'sft'", "set train.backend = torch"]),
    ("rl: {kl_coef: 0.1}\n", ["rl.kl_coef = 0.1", "reference model", "set rl.kl_coef = 0"]),
    ("memory: {weight_bytes: 1}\n", ["memory.weight_bytes = 1", "must be 2", "or 4"]),
])
def test_megatron_settings_it_cannot_run_are_refused_at_load(tmp_path, text, fragments):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "train: {backend: megatron}\n" + text)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("backend, text, fragment", [
    ("megatron", "parallel: {pp: 2}\nmodel: {layers: 2}\n",
     "parallel.pp = 2 must be 1 with train.backend = 'megatron'"),
    ("megatron", "parallel: {ep: 2}\nmodel: {experts: 4, topk: 2}\n", "model.experts = 4"),
    ("torch", "parallel: {tp: 2}\n", "parallel.tp = 2 needs train.backend = megatron"),
])
def test_layouts_a_trainer_cannot_run_are_planned_and_refused_by_preflight(tmp_path, backend, text, fragment):
    """The arithmetic is for the cluster a user will run; submit's pre-flight names what rlslurm cannot run."""
    from rlslurm.plan.report import build_plan, preflight

    job = _load(tmp_path, f"train: {{backend: {backend}}}\nhardware: {{nodes: 2, gpus_per_node: 4}}\n" + text)
    problems = preflight(build_plan(job))
    assert any(fragment in p for p in problems), problems


def test_megatron_loads_for_rl_and_sft_and_torch_is_unaffected(tmp_path):
    assert _load(tmp_path, "train: {backend: megatron}\n").train.backend == "megatron"
    # SFT has no KL term: rl.kl_coef is not the SFT job's business
    assert _load(tmp_path, "train: {backend: megatron}\njob: {kind: sft}\nrl: {kl_coef: 0.1}\n").job.kind == "sft"
    assert _load(tmp_path, "train: {backend: torch}\nrl: {kl_coef: 0.1}\nparallel: {pp: 2}\n").train.backend == "torch"


def test_megatron_trainer_follows_the_plans_memory_settings(tmp_path):
    from rlslurm.megatron.policy import train_config

    job = _load(tmp_path, "train: {backend: megatron}\nmemory: {weight_bytes: 4, recompute: full, "
                          "distributed_optimizer: false}\n")
    cfg = train_config(job)
    assert (cfg.bf16, cfg.recompute, cfg.distributed_optimizer) == (False, "full", False)
    assert train_config(JobConfig()).bf16


def test_checkpoint_shape_is_read_from_config_json_and_other_layouts_are_refused(tmp_path):
    from rlslurm.megatron.policy import hf_model_spec

    config = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 3, "intermediate_size": 512, "vocab_size": 40, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 10000.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec, eps = hf_model_spec(tmp_path)
    assert (spec.layers, spec.hidden, spec.heads, spec.n_kv_heads, spec.ffn_hidden, spec.vocab,
            spec.max_positions, spec.tie_embeddings, eps) == (3, 256, 4, 2, 512, 40, 64, False, 1e-5)
    for change in ({"model_type": "mistral"}, {"head_dim": 128}, {"rope_parameters": {"rope_theta": 5e5}}):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match="config.json"):
            hf_model_spec(tmp_path)


def test_the_smoke_job_loads_and_plans_one_colocated_gpu():
    from rlslurm.plan.render import render_json
    from rlslurm.plan.report import build_plan, preflight

    job = load_config(ROOT / "examples" / "tiny-grpo-gpu.yaml")
    assert (job.train.backend, job.rollout.engine, job.placement.mode, job.train.steps) == ("megatron", "vllm",
                                                                                              "colocate", 2)
    assert job.model.hidden // job.model.heads == 64  # a head size every vLLM attention backend serves
    assert job.rollout.gpu_memory_utilization < 0.5  # the trainer shares the GPU
    plan = build_plan(job)
    assert not preflight(plan)
    data = json.loads(render_json(plan))
    assert (data["chosen"]["placement"], data["chosen"]["train_gpus"]) == ("colocate", 1)
    # The fixture's plan.json is this job's plan: the report's "predicted" is what the planner says.
    assert json.loads((FIXTURE / "plan.json").read_text())["splits"] == data["splits"]


def test_broadcast_beside_trainer_rank_0_on_a_gpu_is_refused_before_submission():
    """Colocated engines share trainer rank 0's GPU, where NCCL refuses a second rank of the sync group: the
    preflight says so and names the fixes; on the cpu profile (gloo) the same job goes."""
    from rlslurm.plan.report import build_plan, preflight

    job = load_config(ROOT / "examples" / "tiny-grpo-gpu.yaml")
    broadcast = dataclasses.replace(job, sync=dataclasses.replace(job.sync, method="broadcast"))
    (problem,) = [p for p in preflight(build_plan(broadcast)) if "broadcast" in p]
    assert "Duplicate GPU detected" in problem and "sync.method: ipc" in problem and "separate" in problem
    on_cpu = dataclasses.replace(broadcast, hardware=dataclasses.replace(job.hardware, profile="cpu"))
    assert not [p for p in preflight(build_plan(on_cpu)) if "broadcast" in p]


def test_smoke_script_is_valid_bash_and_strict():
    script = ROOT / "bench" / "gpu_smoke.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "set -euo pipefail" in text and "nvidia-smi" in text and "bench/gpu_smoke.py run" in text


def _smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "bench" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_report_reads_verify_gbps_and_peak_memory_from_a_run_directory(tmp_path, capsys):
    smoke = _smoke()
    s = smoke.summarize(FIXTURE)
    assert s.ok and s.done and (s.steps_wanted, s.steps_done) == (2, 2)
    assert [(x.version, x.transport, x.verified) for x in s.syncs] == [(0, "ipc", True), (1, "ipc", True),
                                                                       (2, "ipc", True)]
    assert s.nccl is False  # ipc, although the trainer had NCCL
    assert s.predicted_peak_gb == pytest.approx(4.2618)
    assert (s.measured_peak_allocated_gb, s.measured_peak_reserved_gb) == (2.75, 3.02)
    text = smoke.render(s)
    for line in ("sync to v1: ipc, VERIFY passed (attempts 1), update 4.00 GB/s (486.7 MB in 0.122 s)",
                 "NCCL: not exercised", "predicted 4.26 GB", "measured 2.75 GB allocated / 3.02 GB reserved",
                 "measured/predicted 0.65", "result: PASS"):
        assert line in text, text
    assert smoke.main(["report", str(FIXTURE), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["ok"] is True
    capsys.readouterr()


def test_report_fails_on_a_failed_sync_a_missing_step_or_no_memory_figure(tmp_path):
    smoke = _smoke()
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    events = (run / "events.jsonl").read_text().splitlines()
    kept = [e for e in events if '"version": 2' not in e and '"done"' not in e]
    kept.append(json.dumps({"kind": "sync_failed", "version": 2, "transport": "ipc", "reason": "checksum mismatch"}))
    (run / "events.jsonl").write_text("\n".join(kept) + "\n")
    metrics = (run / "metrics.jsonl").read_text().splitlines()[:1]
    (run / "metrics.jsonl").write_text("\n".join(line.replace('"train_peak_allocated_gb"', '"x"') for line in metrics)
                                       + "\n")
    s = smoke.summarize(run)
    assert not s.ok
    problems = " | ".join(s.problems)
    for fragment in ("no `done` event", "1 of train.steps = 2", "sync_failed version 2", "2 verified syncs, expected 3",
                     "no trainer_peak_gb"):
        assert fragment in problems, problems
    assert "result: FAIL" in smoke.render(s)
    # broadcast on a CUDA trainer counts as NCCL
    (run / "events.jsonl").write_text((FIXTURE / "events.jsonl").read_text().replace('"ipc"', '"broadcast"'))
    assert smoke.summarize(run).nccl


# -- the Megatron policy's optimizer checkpoint, around real torch optimizers ----------------------------

def _policy_with_adam(rank: int, world: int, tp: int = 1, seed: int = 0):
    """What OptimizerState reads of a MegatronPolicy, around the torch Adams that Megatron's optimizers
    wrap (`.optimizer`; two chained parts, as with dense and expert parameters): their parameters stand
    for this rank's fp32 master weights."""
    from types import SimpleNamespace

    from rlslurm.dist import Topology

    torch.manual_seed(seed)
    parts = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    adams = [torch.optim.Adam(m.parameters(), lr=0.1) for m in parts]
    policy = SimpleNamespace(topo=Topology(rank, world, rank, "127.0.0.1", 0), layout=SimpleNamespace(tp=tp),
                             job=JobConfig(), steps=0, distributed_optimizer=True,
                             megatron_optimizer=SimpleNamespace(
                                 chained_optimizers=[SimpleNamespace(optimizer=a) for a in adams]))
    return policy, parts, adams


def _adam_step(parts, adams, x):
    for adam in adams:
        adam.zero_grad()
    parts[1](parts[0](x)).square().sum().backward()
    for adam in adams:
        adam.step()


def test_megatron_optimizer_shards_restore_moments_and_master_weights(tmp_path):
    from rlslurm.checkpoint import CheckpointWriter, latest_complete
    from rlslurm.megatron.optimizer_state import OptimizerState
    from rlslurm.rundir import RunDir

    run = RunDir(tmp_path / "run").create()
    x = torch.randn(5, 4)
    kept, kept_parts, kept_adams = _policy_with_adam(rank=1, world=2)
    for _ in range(2):
        _adam_step(kept_parts, kept_adams, x)
    kept.steps = 2
    state = OptimizerState(kept)
    assert OptimizerState(_policy_with_adam(1, 2)[0]).save_shards(tmp_path) == []  # before a step: nothing
    with CheckpointWriter(run, 2) as ckpt:
        ckpt.add_written(*state.save_shards(ckpt.tmp))
        ckpt.save_state("optimizer", state.state_dict())
    ckpt = latest_complete(run)
    assert sorted(ckpt.manifest["files"]) == ["optimizer-rank00001.pt", "optimizer.pt"]

    fresh, fresh_parts, fresh_adams = _policy_with_adam(rank=1, world=2, seed=1)  # other weights, no moments
    restored = OptimizerState(fresh)
    restored.load_state_dict(ckpt.load_state("optimizer"))
    restored.load_shards(ckpt)
    assert fresh.steps == 2
    for a, b in zip(kept_parts, fresh_parts):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    _adam_step(kept_parts, kept_adams, x)
    _adam_step(fresh_parts, fresh_adams, x)
    for a, b in zip(kept_parts, fresh_parts):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

    # Another layout (world size or TP) cannot take these shards: a clear error, not a wrong resume.
    other = OptimizerState(_policy_with_adam(rank=1, world=4)[0])
    other.load_state_dict(ckpt.load_state("optimizer"))
    with pytest.raises(RlslurmError, match="world size and parallel.tp"):
        other.load_shards(ckpt)


def test_a_megatron_checkpoint_without_shards_restarts_adam_with_a_warning(tmp_path, caplog):
    from rlslurm.checkpoint import CheckpointWriter, latest_complete
    from rlslurm.megatron.optimizer_state import OptimizerState
    from rlslurm.rundir import RunDir

    run = RunDir(tmp_path / "run").create()
    with CheckpointWriter(run, 3) as ckpt:  # what this project wrote before the shards
        ckpt.save_state("optimizer", {"backend": "megatron", "steps": 3, "adam_moments": None})
    policy, _, adams = _policy_with_adam(rank=0, world=1)
    state = OptimizerState(policy)
    state.load_state_dict(latest_complete(run).load_state("optimizer"))
    state.load_shards(latest_complete(run))
    assert policy.steps == 3 and not adams[0].state
    assert "holds no optimizer shards" in caplog.text
