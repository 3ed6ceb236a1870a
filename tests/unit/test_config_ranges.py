"""Every number of every config section is finite and inside a range that its docstring states and its check
names; every string has a shape; `rlslurm plan` stays fast on the extremes of the ranges.

Issue 15: infinite or astronomically large numbers reached the planner (OverflowError tracebacks, `plan`
running for minutes), and names broke the run directory (NUL, 5,000 characters). These tests walk the config
classes themselves, so a field added later without a range fails here.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import types
import typing
from pathlib import Path

import pytest

from rlslurm.config import JobConfig, load_config
from rlslurm.configfile import FieldError, field_docs, load_mapping
from rlslurm.errors import ConfigError
from rlslurm.plan.render import render_json, render_text
from rlslurm.plan.report import build_plan

ROOT = Path(__file__).resolve().parents[2]
SPAN = re.compile(r"[\[(]-?[\d.e]+, -?[\d.e]+[\])]")
"""A range as messages and docstrings write it: [1, 64], (0, 86400], (0, 1), [0.001, 1e7]."""


def sections(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, class) of JobConfig and every config class under it (reward.sandbox included)."""
    out = [(prefix, cls)]
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out += sections(f.default_factory, f"{prefix}.{f.name}" if prefix else f.name)
    return out


def _bare(tp: typing.Any) -> typing.Any:
    """int | None -> int; other types unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def fields_of_type(kinds: tuple[type, ...]) -> list[tuple[str, type, str, type]]:
    """(section key, class, field name, bare type) of every field whose type is one of `kinds` (or a dict or
    list of them)."""
    out = []
    for key, cls in sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = _bare(hints[f.name])
            inner = typing.get_args(tp)[-1] if typing.get_origin(tp) in (dict, list) else tp
            if inner in kinds and tp is not bool:
                out.append((key, cls, f.name, tp))
    return out


NUMERIC = [(k, c, n, t) for k, c, n, t in fields_of_type((int, float)) if k]
STRINGS = [(k, c, n, t) for k, c, n, t in fields_of_type((str,)) if k]


def _probes(tp: type) -> list:
    if tp is int:
        return [10**30, -(10**30), 10**400]
    return [math.nan, math.inf, -math.inf, 1e300, -1e300]


def _wrap(tp: type, value):
    return {"train": value} if typing.get_origin(tp) is dict else value


@pytest.mark.parametrize("key,cls,name,tp", NUMERIC, ids=[f"{k}.{n}" for k, _, n, _ in NUMERIC])
def test_every_number_has_a_documented_range(key: str, cls: type, name: str, tp: type):
    bare = typing.get_args(tp)[-1] if typing.get_origin(tp) is dict else tp
    doc = field_docs(cls)[name]
    spans = set()
    for probe in _probes(bare):
        with pytest.raises(FieldError) as err:
            cls(**{name: _wrap(tp, probe)})
        assert err.value.key.split(".")[0] == name, (probe, err.value.key, err.value.message)
        found = SPAN.findall(err.value.message)
        assert found, f"{key}.{name} = {probe!r}: the message names no range: {err.value.message!r}"
        spans.update(found)
    assert len(spans) == 1, f"{key}.{name}: messages name different ranges {spans}"
    (span,) = spans
    assert span in doc, f"{key}.{name}: the docstring must state the range {span}: {doc!r}"


@pytest.mark.parametrize("key,cls,name,tp", NUMERIC[::3], ids=[f"{k}.{n}" for k, _, n, _ in NUMERIC[::3]])
def test_the_loader_names_the_key_of_an_infinite_or_huge_value(key: str, cls: type, name: str, tp: type):
    bare = typing.get_args(tp)[-1] if typing.get_origin(tp) is dict else tp
    value = 10**60 if bare is int else math.inf
    data: dict = {}
    node = data
    for part in key.split("."):
        node = node.setdefault(part, {})
    node[name] = _wrap(tp, value)
    with pytest.raises(ConfigError) as err:
        load_mapping(JobConfig, data, source="job.yaml")
    assert f"job.yaml: {key}.{name}" in str(err.value) and SPAN.search(str(err.value)), str(err.value)


@pytest.mark.parametrize("key,cls,name,tp", STRINGS, ids=[f"{k}.{n}" for k, _, n, _ in STRINGS])
@pytest.mark.parametrize("bad", ["a\x00b", "a\nb\x1b[31m", "x" * 30_000], ids=["nul", "control", "long"])
def test_every_string_is_bounded_and_free_of_control_characters(key: str, cls: type, name: str, tp: type, bad: str):
    if typing.get_origin(tp) is dict:
        value = {bad: 1.0}
    elif typing.get_origin(tp) is list:
        value = [bad]
    else:
        value = bad
    if name == "judge_rubric" and bad.startswith("a\n"):
        value = bad.replace("\n", "")  # a rubric may hold lines; an escape sequence it may not
    with pytest.raises(FieldError) as err:
        cls(**{name: value})
    assert err.value.key.split(".")[0].split("[")[0] == name, err.value.message


@pytest.mark.parametrize("name", ["a/b", ".hidden", "-x", "a b", "é", "x" * 65, ""])
def test_job_name_is_a_safe_file_name(name: str):
    from rlslurm.config import JobSpec

    with pytest.raises(FieldError, match="it names the run directory"):
        JobSpec(name=name)


# -- the planner on the extremes of the ranges ---------------------------------------------------------------

def _range(cls: type, name: str, tp: type) -> tuple[float, float]:
    """(lo, hi) of a numeric field, read from the message its check gives a value far out of range."""
    try:
        cls(**{name: 10**30 if tp is int else 1e300})
    except FieldError as e:
        lo, hi = SPAN.search(e.message).group()[1:-1].split(", ")
        return float(lo), float(hi)
    raise AssertionError(f"{cls.__name__}.{name} took 1e30")


PLANNED = ("model", "parallel", "hardware", "memory", "timing", "placement", "rollout", "rl", "reward", "sync",
           "checkpoint", "cluster")


def _plan_seconds(job: JobConfig) -> float:
    """CPU seconds of this process to plan and render `job`: a bound on the work (what went wrong was a plan
    that ran for minutes), not on the wall clock, which other processes of a loaded CI box stretch."""
    started = time.process_time()
    plan = build_plan(job)
    render_text(plan, explain=True)
    render_json(plan)
    return time.process_time() - started


def _extremes() -> list[tuple[str, dict]]:
    """The lecture's config with one planner input at a time set to the bottom or the top of its range."""
    out = []
    for key, cls, name, tp in NUMERIC:
        if key.split(".")[0] not in PLANNED or typing.get_origin(tp) is dict:
            continue
        lo, hi = _range(cls, name, tp)
        for value in (lo, hi):
            if tp is int:
                value = int(value)
            elif value == 0 and SPAN.search(field_docs(cls)[name]).group().startswith("("):
                value = 1e-9  # (0, hi]: the smallest positive a user would write
            out.append((f"{key}.{name}={value:g}", {key: {name: value}}))
    return out


def _merge(base: dict, change: dict) -> dict:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, fields in change.items():
        node = merged
        for part in key.split("."):
            node = node.setdefault(part, {})
        node.update(fields)
    return merged


def test_plan_is_fast_on_the_extreme_of_every_planner_input():
    import yaml

    base = yaml.safe_load((ROOT / "examples" / "lecture-h20.yaml").read_text())
    timed, refused = [], 0
    for label, change in _extremes():
        try:
            job = load_mapping(JobConfig, _merge(base, change), source=label)
        except ConfigError:
            refused += 1  # e.g. hardware.nodes = 1 with a rollout node: a rule between sections
            continue
        timed.append((_plan_seconds(job), label))
    slowest = max(timed)
    print(f"\n{len(timed)} extreme configs planned (slowest {slowest[0]:.3f} s: {slowest[1]}), {refused} refused")
    assert len(timed) > 150
    assert slowest[0] < 2.0, slowest


def test_plan_is_fast_on_everything_at_the_top_of_its_range(tmp_path: Path):
    """The largest cluster, model and step the ranges allow, all at once (a valid layout of them)."""
    path = tmp_path / "huge.yaml"
    path.write_text("""
hardware: {profile: h20-96g, nodes: 64, gpus_per_node: 64, hbm_gb: 100000, hbm_bandwidth_tb_s: 0.001,
           pcie_gb_s: 0.01, interconnect_gb_s: 0.01, fs_bandwidth_gb_s: 0.001, host_ram_gb: 0.1}
model: {layers: 1024, hidden: 999424, heads: 4096, kv_heads: 4096, head_dim: 65536, ffn_hidden: 10000000,
        vocab: 10000000, max_positions: 100000000, experts: 65536, topk: 1024, expert_ffn_hidden: 10000000}
parallel: {tp: 64, pp: 1024, cp: 1024, ep: 4096, micro_batch_size: 65536, seq_len: 99876864}
memory: {weight_bytes: 64, grad_bytes: 64, optimizer_bytes: 256, recompute: none, temporaries_gb: 1000000,
         other_resident_gb: 1000000}
timing: {train_step_s: 10000000, train_step_ref_gpus: 4096, rollout_s: 10000000, reward_s: 10000000,
         total_steps: 1000000000}
placement: {engine_overhead_gb: 100000, colocate_min_seqs: 1000000}
rollout: {engine: vllm, tp: 64, max_seq_len: 100000000, kv_bytes: 16, max_new_tokens: 1000000}
rl: {prompts_per_step: 100000, samples_per_prompt: 4096}
reward: {latency_s: 86400, concurrency: 1}
checkpoint: {cost_s: 1000000, mtbf_h: 0.000001}
cluster: {time_limit_min: 525600, signal_before_s: 0}
""")
    job = load_config(path)
    assert _plan_seconds(job) < 2.0
    path.write_text("hardware: {nodes: 1, gpus_per_node: 1, hbm_gb: 0.1}\nmodel: {layers: 1, hidden: 1, heads: 1, "
                    "ffn_hidden: 1, vocab: 1, max_positions: 1}\nparallel: {seq_len: 1}\nrollout: {kv_bytes: 0.125, "
                    "max_seq_len: 1, gpu_memory_utilization: 0.000000001}\ntiming: {train_step_s: 0.001}\n")
    assert _plan_seconds(load_config(path)) < 2.0
