"""train.lora (rlslurm/lora.py) on the torch trainer: only the adapters train and hold optimizer state, a sync sends
them alone (VERIFY still naming the frozen base), the merged export is a plain HF model transformers loads with
the trained model's log-probs, its adapter loads with PEFT, an engine's weight memory keeps the base served
across adapter-only updates, and train.backend megatron refuses it.

    python -m pytest -q tests/unit/test_lora.py      # ~15 s on 2 cores
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlslurm.config import JobConfig
from rlslurm.dist import Topology
from rlslurm.lora import LoraConfig, adapters, has_lora, inject, is_adapter, merged_state
from rlslurm.rl.experience import Sample
from rlslurm.rl.policy import Policy
from rlslurm.sync.protocol import Update
from rlslurm.tinymodel import build_model, load_hf, save_hf

LORA = LoraConfig(rank=4, alpha=8.0)


class _Guard:
    def beat(self, step=None):
        pass


def _job(**lora) -> JobConfig:
    job = JobConfig()
    return dataclasses.replace(job, train=dataclasses.replace(job.train, lr=1e-2, lora=LoraConfig(**lora)))


def _samples() -> list[Sample]:
    return [Sample([1, 5, 6, 8], [9, 10, 2], 1.0, 1.0, 0, [-1.0] * 3),
            Sample([1, 5, 7, 8], [11, 2], 0.0, -1.0, 0, [-1.0] * 2)]


@pytest.fixture
def init(tmp_path):
    return save_hf(build_model(JobConfig().model, seed=0), tmp_path / "init")


def test_only_the_adapters_train_and_hold_optimizer_state(init):
    policy = Policy(_job(rank=4), Topology(0, 1, 0, "127.0.0.1", 0), init)
    before = {n: t.clone() for n, t in policy.model.state_dict().items()}
    stats = policy.update(_samples(), _Guard())
    assert stats["grad_norm"] > 0
    policy.update(_samples(), _Guard())  # B is zero at first, so A's gradient is too: the second step moves A
    after = policy.model.state_dict()
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    assert moved and all(is_adapter(n) for n in moved)
    assert {n for n in moved if ".lora_A." in n}, "A moves too once B is off zero"
    assert set(policy.weights()) == set(adapters(policy.model)) and all(is_adapter(n) for n in policy.weights())
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    held = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert len(held) == len(trainable) == len(policy.weights())
    assert set(map(id, policy.optimizer.state)) <= set(map(id, trainable))


def test_a_sync_sends_the_adapters_and_names_the_frozen_base(init):
    from rlslurm.sync.checksum import checksums

    policy = Policy(_job(rank=4), Topology(0, 1, 0, "127.0.0.1", 0), init)
    step = policy.served_weights()
    full = policy.served_weights(full=True)
    assert isinstance(step, Update) and set(step) == set(policy.weights())
    assert set(step) | set(step.unchanged) == set(full) and not set(step) & set(step.unchanged)
    assert step.unchanged == checksums((n, t) for n, t in full.items() if n in step.unchanged)
    sent, whole = (sum(t.numel() * t.element_size() for t in d.values()) for d in (step, full))
    assert sent < whole / 5, (sent, whole)
    plain = Policy(_job(), Topology(0, 1, 0, "127.0.0.1", 0), init)
    assert set(plain.served_weights()) == set(plain.weights()) and not isinstance(plain.served_weights(), Update)
    vllm = dataclasses.replace(_job(rank=4), rollout=dataclasses.replace(JobConfig().rollout, engine="vllm"))
    merged = Policy(vllm, Topology(0, 1, 0, "127.0.0.1", 0), init).served_weights()
    assert set(merged) == set(plain.weights())  # vLLM is sent the plain model's tensors, merged


def _trained_lora(seed: int = 0):
    model = inject(build_model(JobConfig().model, seed=0), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])


def test_the_merged_export_loads_in_transformers_and_its_adapter_in_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _trained_lora()
    with torch.no_grad():
        ours = model(IDS).logits
        base = build_model(JobConfig().model, seed=0)(IDS).logits
    assert (ours - base).abs().max() > 1e-2  # the adapters matter
    save_hf(model, tmp_path / "hf")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not has_lora(plain) and plain.config.tie_word_embeddings == model.config.tie_word_embeddings
    with torch.no_grad():
        assert (plain(IDS).logits - ours).abs().max() < 1e-5
        peft = PeftModel.from_pretrained(build_model(JobConfig().model, seed=0), str(tmp_path / "hf" / "adapter"))
        assert (peft.eval()(IDS).logits - ours).abs().max() < 1e-5
    assert has_lora(model), "the export merged a copy: the trained model keeps its adapters"


def test_merged_state_is_w_plus_scaled_b_a():
    model = _trained_lora()
    state = merged_state(model)
    layer = model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer.weight + (LORA.alpha / LORA.rank) * b @ a
    assert torch.allclose(state["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6)
    assert not [n for n in state if is_adapter(n) or ".base_layer." in n]


def test_an_engine_keeps_its_base_served_across_adapter_only_updates(tmp_path):
    """rlslurm/sync/landing.py's BufferPool: after a first sync of everything, adapter-only updates retire only
    the buffers they wholly replace; a buffer still holding served base tensors never becomes spare (spare
    buffers are landed in by the next update: reusing that one would overwrite the served base)."""
    from rlslurm.rollout.engine import HFEngine
    from rlslurm.sync.landing import BufferPool, Landing

    save_hf(build_model(JobConfig().model, seed=0), tmp_path / "m")
    engine = HFEngine(tmp_path / "m", lora=LORA)
    pool = BufferPool()
    trainer = _trained_lora(1)
    tied = trainer.config.tie_word_embeddings  # a tied head is served once, as model.embed_tokens.weight
    full = {n: t.clone() for n, t in trainer.state_dict().items() if n != "lm_head.weight" or not tied}
    landing = Landing(engine, staged=True, pool=pool)
    landing.land_named(full)
    landing.finish()
    landing.commit()
    base = {n: t.clone() for n, t in engine.named_weights() if not is_adapter(n)}
    buffers = []
    for seed in (2, 3, 4, 5):
        update = adapters(_trained_lora(seed))
        landing = Landing(engine, staged=True, pool=pool)
        landing.land_named(update)
        landing.finish()
        landing.commit()
        served = dict(engine.named_weights())
        spare = {b.untyped_storage().data_ptr() for b in pool._spare}
        assert not spare & {t.untyped_storage().data_ptr() for t in served.values()}, "a served buffer is spare"
        assert all(torch.equal(served[n], t) for n, t in update.items())
        assert all(torch.equal(served[n], t) for n, t in base.items())
        buffers.append((len(pool.serving), pool.spare_bytes))
    assert buffers[1:] == buffers[2:] + buffers[-1:], f"the pool grows: {buffers}"  # two sets, in turn


def test_megatron_refuses_lora(tmp_path):
    from click.testing import CliRunner

    from rlslurm.cli.main import cli

    path = tmp_path / "job.yaml"
    path.write_text("job: {name: x, kind: rl}\ntrain: {backend: megatron, lora: {rank: 8}}\nrl: {kl_coef: 0}\n"
                    "memory: {weight_bytes: 4}\n")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code != 0 and "train.lora.rank = 8 is refused with train.backend = 'megatron'" in \
        " ".join(result.output.split())


@pytest.mark.parametrize("text,fragment", [("train: {lora: {rank: -1}}\n", "train.lora.rank"),
                                           ("train: {lora: {rank: 4, dropout: 1.0}}\n", "train.lora.dropout"),
                                           ("train: {lora: {rank: 4, targets: []}}\n", "train.lora.targets")])
def test_bad_lora_values_are_refused(tmp_path, text, fragment):
    from rlslurm.config import load_config
    from rlslurm.errors import ConfigError

    path = tmp_path / "job.yaml"
    path.write_text("job: {name: x}\n" + text)
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(path)


def test_a_target_the_model_lacks_is_named(init):
    from rlslurm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.lora.targets = \['c_attn'\].*q_proj"):
        inject(load_hf(init)[0], LoraConfig(rank=4, targets=("c_attn",)))


def test_the_adapters_start_from_train_seed_alone():
    """A run and its repeat (or its resumed twin) start from the same adapters, whatever the process's RNG did."""
    def start(seed: int) -> dict:
        torch.manual_seed(torch.seed())  # the global RNG anywhere
        return adapters(inject(build_model(JobConfig().model, seed=0), LORA, seed=seed))

    one, again, other = start(0), start(0), start(1)
    assert all(torch.equal(one[n], again[n]) for n in one)
    assert any(not torch.equal(one[n], other[n]) for n in one if ".lora_A." in n)


def test_a_checkpoint_of_the_other_train_lora_is_refused(init, tmp_path):
    """A LoRA checkpoint holds adapters, a full one the model: loading one into the other would fit some names and
    silently skip the rest, so the resume is refused naming a tensor."""
    from rlslurm.checkpoint import Checkpoint, CheckpointWriter, latest_complete
    from rlslurm.errors import CheckpointError
    from rlslurm.rl.checkpointing import load
    from rlslurm.rundir import RunDir

    topo = Topology(0, 1, 0, "127.0.0.1", 0)
    run = RunDir(tmp_path / "run").create()
    lora = Policy(_job(rank=4), topo, init)
    with CheckpointWriter(run, 1, policy_version=1, keep=2) as ckpt:
        ckpt.save_tensors("model", {k: v.contiguous() for k, v in lora.weights().items()})
        ckpt.save_state("optimizer", lora.optimizer.state_dict())
        ckpt.save_state("rng", [{"torch": torch.get_rng_state(), "python": __import__("random").getstate()}])
        ckpt.save_json("rl_state", {"step": 1, "policy_version": 1})
    ckpt = Checkpoint.open(latest_complete(run).path)
    load(ckpt, Policy(_job(rank=4), topo, init), topo)  # its own kind loads
    with pytest.raises(CheckpointError, match=r"lora_A.*another train.lora"):
        load(ckpt, Policy(_job(), topo, init), topo)
