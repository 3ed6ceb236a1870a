"""The data layer on real files (jsonl, json, parquet, a save_to_disk directory) read by `datasets`:
layouts detected or named, dotted column keys, Samples, the seeded eval_fraction split, the sampler's saved
position, and the generated arithmetic read through the same path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.config import load_config
from rlslurm.data.layout import DataError
from rlslurm.data.sampler import Sampler
from rlslurm.data.splits import load_splits, open_table
from rlslurm.errors import ConfigError
from rlslurm.tasks.arithmetic import make_splits

VERL = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
         "extra_info": {"split": "train", "index": i}} for i in range(10)]


def _job(tmp_path: Path, data: dict, kind: str = "sft"):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"job": {"kind": kind}, "data": data}))
    return load_config(path)


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".dir"])
def test_every_file_form_reads_the_same_samples(tmp_path, suffix):
    rows = [{"prompt": f"{i}*2=", "completion": str(2 * i), "answer": str(2 * i), "topic": "mul"} for i in range(20)]
    path = _write(tmp_path / f"train{suffix}", rows)
    train, held = load_splits(_job(tmp_path, {"train": str(path), "eval_fraction": 0.25}))
    assert train.layout.name == "trl_prompt_completion" and train.layout.reference == "answer"
    assert (len(train), len(held)) == (15, 5)
    seen = sorted([train.sample(i) for i in range(len(train))] + held.samples(), key=lambda s: s.row)
    assert [s.prompt for s in seen] == [r["prompt"] for r in rows]
    assert seen[3].completion == "6" and seen[3].reference == "6" and seen[3].extra == {"topic": "mul"}


def test_the_eval_fraction_split_is_seeded_disjoint_and_stable(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"prompt": f"{i}=", "completion": "1"} for i in range(100)])
    rows = {}
    for seed in (0, 0, 1):
        train, held = load_splits(_job(tmp_path, {"train": str(path), "eval_fraction": 0.1, "seed": seed}))
        held_rows = tuple(s.row for s in held.samples())
        assert len(held_rows) == 10 and not set(held_rows) & {train.sample(i).row for i in range(len(train))}
        rows.setdefault(seed, set()).add(held_rows)
    assert len(rows[0]) == 1, "the same seed must hold out the same rows"
    assert rows[0] != rows[1], "the seed must matter"


def test_verl_parquet_is_detected_with_its_struct_ground_truth(tmp_path):
    path = _write(tmp_path / "verl.parquet", VERL)
    job = _job(tmp_path, {"train": str(path), "eval": str(path)}, kind="sft")
    train = open_table(job.data, str(path), "data.train", frozenset({"reference"}))  # what RL reads
    s = train.sample(4)
    assert train.layout.name == "verl" and train.layout.reference == "reward_model.ground_truth"
    assert s.is_chat and s.prompt == [{"role": "user", "content": "What is 4 + 1?"}] and s.reference == "5"
    assert s.extra["data_source"] == "openai/gsm8k" and s.extra["extra_info"] == {"split": "train", "index": 4}
    with pytest.raises(DataError, match=r"row 0, column 'completion': has no completion to learn"):
        load_splits(job)[0].sample(0)


def test_messages_rows_split_into_prompt_and_the_assistant_turn(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1*2"},
                          {"role": "assistant", "content": "2"}]}]
    path = _write(tmp_path / "chat.jsonl", rows * 3)
    train, _ = load_splits(_job(tmp_path, {"train": str(path), "eval": str(path)}))
    s = train.sample(0)
    assert train.layout.name == "trl_messages" and s.completion == "2"
    assert s.prompt == rows[0]["messages"][:2]


def test_named_columns_with_dotted_paths(tmp_path):
    rows = [{"q": {"text": f"{i}+1="}, "a": {"value": str(i + 1)}, "id": i} for i in range(4)]
    path = _write(tmp_path / "t.parquet", rows)
    train, _ = load_splits(_job(tmp_path, {"train": str(path), "eval": str(path), "layout": "columns",
                                           "columns": {"prompt": "q.text", "completion": "a.value"}}))
    s = train.sample(2)
    assert (s.prompt, s.completion, s.extra) == ("2+1=", "3", {"id": 2})


def test_without_data_the_generated_task_is_read_through_the_same_path(tmp_path):
    job = _job(tmp_path, {})
    train, held = load_splits(job)
    problems, held_problems = make_splits(job.task)
    assert len(train) == len(problems) and len(held) == len(held_problems)
    for i in (0, 7, len(problems) - 1):
        s = train.sample(i)
        assert (s.prompt, s.completion, s.reference) == (problems[i].prompt, problems[i].target, problems[i].target)


def test_the_sampler_is_seeded_epoch_by_epoch_and_its_saved_position_resumes_it():
    sampler = Sampler(10, seed=3)
    stream = sampler.indices(0, 35)
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20], "each epoch is its own permutation"
    state = sampler.state(23)
    assert state == {"epoch": 2, "index": 3, "rows": 10, "seed": 3}
    resumed = Sampler(10, seed=3)
    assert resumed.indices(resumed.position(state), 12) == stream[23:35]
    assert Sampler(10, seed=4).indices(0, 10) != stream[:10]
    with pytest.raises(ValueError, match="this job has 11 rows under seed 3"):
        Sampler(11, seed=3).position(state)


def test_data_keys_are_validated_once_and_named(tmp_path):
    bad = [({"train": "t.jsonl"}, "data.eval or data.eval_fraction is required"),
           ({"train": "t.jsonl", "eval": "e.jsonl", "eval_fraction": 0.1}, "both choose the held-out rows"),
           ({"eval_fraction": 0.1}, "needs data.train"),
           ({"train": "t.jsonl", "eval_fraction": 0.9}, "data.eval_fraction = 0.9 must be <= 0.5"),
           ({"train": "t.jsonl", "eval_fraction": 0.1, "layout": "alpaca"}, "data.layout = 'alpaca' must be one of"),
           ({"train": "t.jsonl", "eval_fraction": 0.1, "colums": {}}, "data.colums is not a key of data. Did you mean"),
           ({"train": "t.jsonl", "eval_fraction": 0.1, "layout": "columns"}, "data.columns.prompt is required"),
           ({"train": "t.jsonl", "eval_fraction": 0.1, "columns": {"prompt": "a..b"}},
            "data.columns.prompt = 'a..b' must be")]
    for data, words in bad:
        with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
            _job(tmp_path, data)
    # GRPO on a user's rows is built: job.kind = rl takes data.train as sft does
    assert _job(tmp_path, {"train": "t.jsonl", "eval_fraction": 0.1}, kind="rl").data.train == "t.jsonl"
    with pytest.raises(ConfigError, match=r"data\.max_bad_share = 1\.5 must be <= 1"):
        _job(tmp_path, {"train": "t.jsonl", "eval_fraction": 0.1, "max_bad_share": 1.5})


def test_a_list_or_mapping_ground_truth_reaches_a_reward_function_and_is_refused_for_the_rest(tmp_path):
    """docs/data.md and validate agree (issue 37): a verl ground truth that is a list or a mapping (Search-R1's
    {"target": [...]}) is kept for reward.scorer = function, which gets it as that value; every other scorer
    compares text, and validate refuses the row, naming the column and the scorer that would take it."""
    from rlslurm.data.check import check_data
    from rlslurm.reward.items import item_for

    rows = [dict(row, reward_model={"style": "rule", "ground_truth": {"target": [str(i + 1), "one more"]}})
            for i, row in enumerate(VERL)]
    data = {"train": str(_write(tmp_path / "t.jsonl", rows)), "eval_fraction": 0.2}
    (tmp_path / "rewards.py").write_text("def compute_score(data_source, solution_str, ground_truth, "
                                         "extra_info=None):\n    return 0.0\n")
    function = tmp_path / "job.yaml"
    function.write_text(json.dumps({"job": {"kind": "rl"}, "data": data, "reward": {
        "scorer": "function", "function": str(tmp_path / "rewards.py"), "service": "local"}}))
    job = load_config(function)
    assert "ok, 10 rows checked" in check_data(job)[0]
    train, _ = load_splits(job)
    item = item_for(train.sample(0), "2", "0")
    assert item.reference_is_json and json.loads(item.reference)["target"][1] == "one more"
    with pytest.raises(DataError, match=r"'reward_model.ground_truth': is a mapping; a ground truth must be text or "
                                        r"a number \(a list or mapping reaches a reward function only"):
        check_data(_job(tmp_path, data, kind="rl"))
