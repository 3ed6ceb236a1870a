"""The arithmetic task and its tokenizer: determinism, disjoint splits, the scoring rule, AutoTokenizer load."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlslurm.config import load_config
from rlslurm.errors import ConfigError
from rlslurm.tasks.arithmetic import (
    Problem,
    all_problems,
    make_splits,
    parse_answer,
    parse_answer_lenient,
    parse_prompt,
    score,
)
from rlslurm.tasks.config import TaskConfig, distinct_problems
from rlslurm.tokenizer import EOS, VOCAB, build_tokenizer, save_tokenizer


def test_splits_are_deterministic_from_the_seed():
    task = TaskConfig(train_size=500, eval_size=100, seed=7)
    assert make_splits(task) == make_splits(TaskConfig(train_size=500, eval_size=100, seed=7))
    assert make_splits(task)[0] != make_splits(TaskConfig(train_size=500, eval_size=100, seed=8))[0]


@pytest.mark.parametrize("max_operand,ops", [(99, ("+", "-")), (9, ("+",)), (5, ("-",))])
def test_splits_are_disjoint_and_answers_exact(max_operand, ops):
    total = distinct_problems(max_operand, ops)
    assert total == len(all_problems(max_operand, ops)) == len(set(all_problems(max_operand, ops)))
    eval_size = max(1, total // 10)
    train, held_out = make_splits(TaskConfig(max_operand=max_operand, operations=ops,
                                             train_size=total - eval_size, eval_size=eval_size))
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert len(train) + len(held_out) == total
    for p in train + held_out:
        a, b = p.prompt[:-1].split(p.op)
        assert p.answer == eval(f"{int(a)}{p.op}{int(b)}") >= 0


def test_too_many_problems_for_the_operand_range_is_a_config_error(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("task: {max_operand: 9, operations: ['+'], train_size: 90, eval_size: 20}\n")
    with pytest.raises(ConfigError, match=r"task.train_size = 90 \+ task.eval_size = 20 exceeds the 100"):
        load_config(path)


@pytest.mark.parametrize("response,expected", [
    ("19", 1.0), (" 19 ", 1.0), ("19</s>", 1.0), ("<s>19</s><pad>", 1.0), ("019", 1.0), ("1 9", 1.0),
    ("+19", 1.0), ("18", 0.0), ("19=19", 0.0), ("19+", 0.0), ("", 0.0), ("nineteen", 0.0), ("-19", 0.0),
])
def test_score_is_exact_match_after_normalisation(response, expected):
    assert score(Problem(12, "+", 7), response) == expected


@pytest.mark.parametrize("response,stated", [
    ("12 + 7 = 19", 19), ("The answer is 19.", 19), ("19", 19), ("12 + 7 = 19, and 3 = 3", 19),
    ("= 19 20", 19), ("12+7=019", 19), ("7 - 7 = 0", 0), ("= -3", -3), ("19</s>", 19), ("none", None),
    ("12 + 7 =", None), ("", None),
])
def test_lenient_answer_is_the_first_integer_after_the_first_equals_sign(response, stated):
    assert parse_answer_lenient(response) == stated
    assert score(Problem(12, "+", 7), response, "lenient") == float(stated == 19)


def test_parse_prompt_inverts_the_prompt_format():
    for p in all_problems(12, ("+", "-")):
        assert parse_prompt(p.prompt) == p
    with pytest.raises(ValueError, match="not an arithmetic task prompt"):
        parse_prompt("12 + 7 =")


def test_chat_question_may_name_only_the_problems_fields(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("task: {prompt_style: chat, chat_question: 'What is {x}?'}\n")
    with pytest.raises(ConfigError,
                       match=r"task.chat_question = 'What is \{x\}\?' may name only \{a\}, \{op\} and \{b\}"):
        load_config(path)


def test_parse_answer_reads_negative_integers():
    assert parse_answer(" -5</s>") == -5
    assert parse_answer("5-") is None


def test_prompt_and_target_format():
    p = Problem(42, "-", 17)
    assert (p.prompt, p.target, p.answer) == ("42-17=", "25", 25)


def test_tokenizer_round_trip_one_token_per_character():
    tok = build_tokenizer()
    for text in ("12+7=19", "99-0=99", "3 * 4 = 12"):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok("5+5=")["input_ids"] + [tok.eos_token_id]) == "<s>5+5=" + EOS


def test_saved_tokenizer_loads_with_autotokenizer(tmp_path: Path):
    written = {p.name for p in save_tokenizer(tmp_path, max_length=64)}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= written
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    original = build_tokenizer()
    assert loaded.get_vocab() == original.get_vocab() == VOCAB
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<s>", "</s>", "<pad>")
    assert loaded.model_max_length == 64 and loaded.padding_side == "left"
    for text in ("12+7=", "0-0=0"):
        assert loaded(text)["input_ids"] == original(text)["input_ids"]
    batch = loaded(["1+1=", "12+13="], padding=True)
    assert batch["input_ids"][0][:2] == [loaded.pad_token_id] * 2, "generation batches pad on the left"
