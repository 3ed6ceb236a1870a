"""The engine side of an update (rlslurm/sync/landing.py): a staged update is checksummed as it lands,
leaves the served weights untouched until commit, is swapped in by reference (no copy) and undone
by dropping it; its buffers are reused by the update after next; an in-place update loads as it
lands. HFEngine.adopt_weights is all-or-none and follows tied weights."""

from __future__ import annotations

import pytest
import torch

from rlslurm.modelspec import ModelConfig
from rlslurm.rollout.engine import Engine, HFEngine, WeightLoadError
from rlslurm.sync.buckets import flatten_into, manifest_of, plan_buckets
from rlslurm.sync.checksum import checksums
from rlslurm.sync.landing import BufferPool, Landing
from rlslurm.tinymodel import build_model, save_hf


class DictEngine(Engine):
    """Serves a dict of tensors; adopts by replacing dict entries."""

    model_name = "dict"
    version = 0

    def __init__(self, tensors: dict[str, torch.Tensor], adopts: bool = True):
        self.served = dict(tensors)
        self.adopts_weights = adopts
        self.loads = 0

    def generate(self, prompts, params):
        raise NotImplementedError

    def named_weights(self):
        return iter(self.served.items())

    def load_weights(self, named):
        n = 0
        for name, t in named:
            self.served[name].copy_(t)
            n += t.numel() * t.element_size()
        self.loads += 1
        return n

    def adopt_weights(self, named):
        self.served.update(named)
        return sum(t.numel() * t.element_size() for t in named.values())


def make(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(40, 30, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
            "c": torch.randint(-9, 9, (5, 3), generator=g).to(torch.int64), "d": torch.randn(1000, generator=g)}


def land_all(landing: Landing, tensors: dict, bucket_bytes: int = 4096, foreign: bool = False) -> None:
    for i, bucket in enumerate(plan_buckets(manifest_of(tensors), bucket_bytes)):
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8) if foreign else landing.buffer(i, bucket.nbytes)
        landing.land(i, bucket, flatten_into(flat, bucket, tensors))
    landing.finish()


@pytest.mark.parametrize("foreign", [False, True])
def test_staged_update_is_checksummed_invisible_until_commit_then_adopted(foreign):
    old, new = make(0), make(1)
    engine = DictEngine({k: v.clone() for k, v in old.items()})
    landing = Landing(engine, staged=True)
    land_all(landing, new, foreign=foreign)
    assert landing.checksums == checksums(new.items())
    assert checksums(engine.named_weights()) == checksums(old.items())  # nothing served changed yet
    landing.commit()
    assert checksums(engine.named_weights()) == checksums(new.items())
    buffers = landing.pool.serving
    for t in engine.served.values():  # adopted by reference: views of the landing's buffers
        assert any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in buffers)
    assert engine.loads == 0


def test_dropped_update_leaves_the_served_weights_and_the_buffers_are_reused():
    pool = BufferPool()
    engine = DictEngine(make(0))
    first = Landing(engine, staged=True, pool=pool)
    land_all(first, make(1))
    first.commit()  # retires the weights loaded at start: nothing spare yet
    second = Landing(engine, staged=True, pool=pool)
    land_all(second, make(2))
    second.commit()  # retires the first landing's buffers: spare for the next
    retired = {b.data_ptr() for b in pool.serving}
    assert pool.spare_bytes > 0
    third = Landing(engine, staged=True, pool=pool)
    land_all(third, make(3))
    landed = {b.data_ptr() for b in third.buffers.values()}
    assert landed.isdisjoint(retired)  # never the served set
    third.drop()
    assert checksums(engine.named_weights()) == checksums(make(2).items())
    fourth = Landing(engine, staged=True, pool=pool)
    land_all(fourth, make(4))
    assert {b.data_ptr() for b in fourth.buffers.values()} == landed


def test_a_tensor_the_engine_does_not_serve_or_of_another_shape_is_refused():
    engine = DictEngine(make(0))
    for bad in ({"zzz": torch.zeros(3)}, {"a": torch.zeros(30, 40)}, {"b": torch.zeros(7)}):
        landing = Landing(engine, staged=True)
        with pytest.raises(WeightLoadError):
            land_all(landing, bad)
        landing.drop()
    assert checksums(engine.named_weights()) == checksums(make(0).items())


def test_in_place_update_loads_as_it_lands_and_leaves_checksums_to_the_engine():
    engine = DictEngine({k: v.clone() for k, v in make(0).items()}, adopts=False)
    with pytest.raises(ValueError, match="cannot adopt"):
        Landing(engine, staged=True)
    landing = Landing(engine, staged=False)
    land_all(landing, make(1), bucket_bytes=1024)
    assert landing.checksums is None and engine.loads > 1
    assert checksums(engine.named_weights()) == checksums(make(1).items())


def test_in_place_scratch_lives_on_the_transports_device_staged_on_the_served_one():
    """vLLM's weights live in its worker: in place, a broadcast lands in the group's device (NCCL receives
    only into GPU memory); staged buffers are served, so they stay on the served weights' device. The meta
    device stands in for CUDA here: only the placement is under test."""
    meta = torch.device("meta")
    in_place = Landing(DictEngine({k: v.clone() for k, v in make(0).items()}, adopts=False), staged=False)
    assert in_place.buffer(0, 64).device.type == "cpu"
    assert in_place.buffer(0, 64, device=meta).device == meta  # the slot follows the device asked for
    staged = Landing(DictEngine({k: v.clone() for k, v in make(0).items()}, adopts=True), staged=True)
    assert staged.buffer(0, 64, device=meta).device.type == "cpu"


@pytest.fixture(scope="module")
def hf_engine(tmp_path_factory):
    spec = ModelConfig(hidden=32, ffn_hidden=64, layers=1, heads=4)
    path = save_hf(build_model(spec, seed=0), tmp_path_factory.mktemp("m") / "model")
    return HFEngine(path), dict(build_model(spec, seed=1).state_dict())


def test_hf_adopt_is_all_or_none_and_follows_tied_weights(hf_engine):
    engine, new = hf_engine
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # tied
    before = checksums(engine.named_weights())
    served = dict(engine.named_weights())
    assert "lm_head.weight" not in served  # the tied alias is served (and sent) once
    update = {n: new[n].clone() for n in served}
    with pytest.raises(WeightLoadError):
        engine.adopt_weights({**update, "model.norm.weight": torch.zeros(3)})
    assert checksums(engine.named_weights()) == before  # nothing swapped
    engine.adopt_weights(update)
    assert checksums(engine.named_weights()) == checksums(update.items())
    assert engine.model.lm_head.weight.data_ptr() == update["model.embed_tokens.weight"].data_ptr()
