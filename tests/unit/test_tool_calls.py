"""Tool calls read from a model turn (Hermes' and the embedded model's formats), tool schemas from a function, the
calculator's bounds, and tool-using conversations as tokens (the SFT labels and the RL pieces agree)."""

from __future__ import annotations

import time

import pytest

from rlslurm.data.layout import RowError
from rlslurm.data.messages import MessageError, read_messages, read_tools
from rlslurm.data.sample import Sample
from rlslurm.data.tokens import IGNORE, encode
from rlslurm.data.turns import TurnTemplate
from rlslurm.tokenizer import FIRST_VOCAB, VOCAB, build_tokenizer, is_embedded
from rlslurm.tools.builtin import ToolError, calculate
from rlslurm.tools.calls import EmbeddedFormat, HermesFormat
from rlslurm.tools.schema import check_arguments, function_schema

# -- Hermes / Qwen ---------------------------------------------------------------------------------------

def test_hermes_reads_each_call_and_the_answer_around_them():
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call> done')
    turn = HermesFormat().parse(text)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("calculator", {"expression": "2+3"}, None), ("lookup", {"city": "Oslo"}, None)]
    assert turn.answer == "Let me compute.  done"


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not JSON"),
    ('<tool_call>["calculator"]</tool_call>', "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "names no tool"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', "arguments are not JSON"),
    ('<tool_call>{"name": "calculator"', "never closed"),
    ('answer </tool_call>', "without <tool_call>"),
])
def test_hermes_malformed_calls_are_calls_with_an_error(text, error):
    turn = HermesFormat().parse(text)
    assert len(turn.calls) == 1 and turn.calls[0].error is not None and error in turn.calls[0].error


def test_hermes_turn_without_a_call_is_an_answer():
    turn = HermesFormat().parse("  5535 ")
    assert turn.calls == [] and turn.answer == "5535"


# -- the embedded model's own format ------------------------------------------------------------------------

def test_embedded_brackets_call_the_first_tool_with_its_first_parameter():
    turn = EmbeddedFormat("calculator", "expression").parse("[123*45][2+2]7")
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": "123*45"}),
                                                           ("calculator", {"expression": "2+2"})]
    assert turn.answer == "7"


@pytest.mark.parametrize("text", ["[123*45", "12]", "[[1]]", "[1]]"])
def test_embedded_stray_brackets_are_malformed(text):
    turn = EmbeddedFormat("calculator", "expression").parse(text)
    assert any(c.error for c in turn.calls)


# -- schemas from a function ----------------------------------------------------------------------------

def lookup(city: str, days: int = 1, metric: bool | None = None, *, api_key: str = "") -> str:
    """Weather for a city.

    Args:
        city: The city's name.
        days (int): How many days
            ahead.
    """
    return city


def test_schema_from_signature_and_docstring_hides_keyword_only_context():
    schema = function_schema(lookup, "lookup")["function"]
    assert schema["description"] == "Weather for a city."
    assert schema["parameters"]["properties"] == {
        "city": {"type": "string", "description": "The city's name."},
        "days": {"type": "integer", "description": "How many days ahead."}, "metric": {"type": "boolean"}}
    assert schema["parameters"]["required"] == ["city"]


@pytest.mark.parametrize("arguments, problem", [
    ({"city": "Oslo"}, None), ({"city": "Oslo", "days": 2.0}, None), ({}, "missing argument 'city'"),
    ({"city": "Oslo", "api_key": "x"}, "unknown argument 'api_key'"), ({"city": 3}, "'city' must be string"),
    ({"city": "Oslo", "days": "2"}, "'days' must be integer"), ({"city": "Oslo", "metric": 1}, "must be boolean"),
])
def test_arguments_checked_against_the_schema(arguments, problem):
    got = check_arguments(function_schema(lookup, "lookup"), arguments)
    assert got == problem if problem is None else problem in got


# -- the calculator ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [("123*45", "5535"), ("7/2", "3.5"), ("(2+3)*-4", "-20"),
                                               ("2**10", "1024"), ("10//3", "3"), ("6/3", "2"), ("1.5*2", "3")])
def test_calculator(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, problem", [
    ("9**9**9", "digits"), ("10**200", "digits"), ("1/0", "division by zero"), ("__import__('os')", "only numbers"),
    ("x+1", "only numbers"), ("1+", "not an arithmetic"), ("1" * 300, "at most"), ("(-8)**0.5", "not a real"),
    ("[1]*3", "only numbers"),
])
def test_calculator_refuses_quickly(expression, problem):
    t = time.monotonic()
    with pytest.raises(ToolError, match=problem):
        calculate(expression)
    assert time.monotonic() - t < 0.5


# -- data rows with tool turns ---------------------------------------------------------------------------------

def test_tool_messages_normalised_and_refused_by_field():
    rows = read_messages([{"role": "user", "content": "q"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                          {"role": "tool", "content": "r", "name": "f", "tool_call_id": "c1", "tool_calls": None}],
                         "messages")
    assert rows[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "c1"}]}
    assert rows[2] == {"role": "tool", "content": "r", "name": "f", "tool_call_id": "c1"}
    bad = [({"role": "user", "content": "q", "tool_calls": []}, "messages[0].tool_calls"),
           ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
            "messages[0].tool_calls[0].function.arguments"),
           ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]},
            "messages[0].tool_calls[0].function.name"),
           ({"role": "tool", "content": "r", "name": 3}, "messages[0].name")]
    for message, column in bad:
        with pytest.raises(MessageError) as e:
            read_messages([message, {"role": "user", "content": "q"}], "messages")
        assert e.value.column == column
    with pytest.raises(MessageError):
        read_tools('[{"no": "name"}]', "tools")
    assert read_tools(['{"name": "f"}'], "tools") == [{"type": "function", "function": {"name": "f"}}]


def test_trl_tool_rows_become_turns_and_every_assistant_turn_is_learned(tmp_path):
    import json

    from rlslurm.data.config import DataConfig
    from rlslurm.data.splits import open_table
    from rlslurm.tasks.calculator import CALCULATOR_SCHEMA, trace

    # Two rows whose calls take different arguments: Arrow gives each the other's as null (dropped on reading).
    other = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "name": "lookup", "content": "sun"}, {"role": "assistant", "content": "sun"}]
    (tmp_path / "t.jsonl").write_text(json.dumps({"messages": trace(123, 45), "tools": [CALCULATOR_SCHEMA]}) + "\n"
                                      + json.dumps({"messages": other, "tools": None}) + "\n")
    table = open_table(DataConfig(train=str(tmp_path / "t.jsonl"), eval_fraction=0.5), str(tmp_path / "t.jsonl"),
                       "data.train", frozenset())
    assert table.sample(1).turns[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    sample = table.sample(0)
    assert sample.prompt == [{"role": "user", "content": "123*45"}] and len(sample.turns) == 3
    assert sample.completion == "5535" and sample.extra["tools"] == [CALCULATOR_SCHEMA]
    tok = build_tokenizer(chat=True)
    ids, labels = encode(tok, sample)
    text = tok.decode(ids)
    assert text == "<s>123*45=[123*45]</s>(5535)5535</s>"
    learned = "".join(tok.decode([i]) for i, y in zip(ids, labels) if y != IGNORE)
    assert learned == "[123*45]</s>5535</s>"  # the tool's result is given, never learned


def test_rl_pieces_are_the_sft_pieces():
    """An episode's ids (prompt, the model's, the template's between turns) are the SFT encoding's, token for
    token: what SFT taught is what RL continues."""
    from rlslurm.tasks.calculator import trace

    tok = build_tokenizer(chat=True)
    messages = trace(123, 45)
    sft_ids, labels = encode(tok, Sample(prompt=messages[:1], turns=messages[1:]))
    t = TurnTemplate(tok)
    model_turn_1, model_turn_2 = tok("[123*45]", add_special_tokens=False)["input_ids"], [
        *tok("5535", add_special_tokens=False)["input_ids"]]
    episode = (t.prompt_ids(messages[:1]) + model_turn_1 + [tok.eos_token_id]
               + t.between_turns([messages[2]], ended_with_eos=True) + model_turn_2 + [tok.eos_token_id])
    assert episode == sft_ids


def test_embedded_vocabulary_only_grows():
    assert FIRST_VOCAB == 19 and all(VOCAB[c] < FIRST_VOCAB for c in "0123456789+-*= ")

    class Old:  # an export made before the tool characters: its first 19 ids
        def get_vocab(self):
            return {t: i for t, i in VOCAB.items() if i < FIRST_VOCAB}

    assert is_embedded(Old()) and is_embedded(build_tokenizer())


def test_a_row_with_a_bad_tool_call_is_named(tmp_path):
    import json

    from rlslurm.data.config import DataConfig
    from rlslurm.data.splits import open_table

    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                          "arguments": "{"}}]},
                        {"role": "assistant", "content": "a"}]}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    table = open_table(DataConfig(train=str(tmp_path / "t.jsonl"), eval_fraction=0.5), str(tmp_path / "t.jsonl"),
                       "data.train", frozenset())
    got = table.try_sample(0)
    assert isinstance(got, RowError) and got.column == "messages[1].tool_calls[0].function.arguments"
