"""The calculator task: 3-digit x 2-digit products, which the embedded model cannot work out in its head but can
with a calculator; its rows in the layouts users bring (TRL messages with tool calls, TRL prompts, verl).

    python -m rlslurm.tasks.calculator --out data/calc        # the files examples/tool-{sft,grpo}.yaml read

Writes, from disjoint shuffled splits of every a*b with a in 100..999 and b in 10..99 (81,000 problems):

    sft-tools.jsonl    TRL conversational rows: user "123*45", an assistant turn calling calculator(expression=
                       "123*45"), the tool turn "5535", the assistant's answer "5535"; a `tools` column with the
                       calculator's schema. The embedded model's template renders it as
                       "<s>123*45=[123*45]</s>(5535)5535</s>" (rlslurm/tokenizer.py CHAT_TEMPLATE).
    sft-direct.jsonl   the same problems answered with no tool ("123*45" -> "5535"): the model in its head.
    sft.jsonl          what examples/tool-sft.yaml learns from: a teacher that calls the calculator on `tool_share`
                       (35 %) of the problems and answers in its head on the rest, row by row from the two above.
                       Its student calls the tool on some problems and guesses on the others, which GRPO with the
                       tool then turns into calling it (docs/agentic.md says why not SFT on tool traces alone).
    train.jsonl        RL prompts: [user "123*45"], `ground_truth` "5535", the `tools` column.
    test.jsonl         held-out RL prompts, the same columns (disjoint from every split above).
    train-verl.parquet, test-verl.parquet   the RL rows in verl's layout, extra_info.tools_kwargs included.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "The expression, e.g. 123*45"}},
        "required": ["expression"]}}}


def problems(seed: int) -> list[tuple[int, int]]:
    """Every (a, b), a in 100..999 and b in 10..99, shuffled by `seed` (stable across Python versions)."""
    out = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(seed).shuffle(out)
    return out


def question(a: int, b: int) -> str:
    return f"{a}*{b}"


def trace(a: int, b: int) -> list[dict]:
    """The tool-using conversation that answers a*b (TRL's layout: tool_calls, then a tool turn)."""
    q = question(a, b)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": q}}}
    return [{"role": "user", "content": q}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


def rl_row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b)}], "ground_truth": str(a * b),
            "tools": [CALCULATOR_SCHEMA]}


def verl_row(a: int, b: int, split: str, index: int) -> dict:
    """verl's layout; extra_info.tools_kwargs as verl's tool config hands each row's arguments to its tools."""
    return {"data_source": "calculator", "prompt": [{"role": "user", "content": question(a, b)}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index,
                           "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": str(a * b)}}}}}


def write(out: Path, *, seed: int = 0, sft_rows: int = 20000, train_rows: int = 20000, test_rows: int = 1000,
          tool_share: float = 0.35) -> dict:
    """The task's files under `out`; returns {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    every = problems(seed)
    test, rest = every[:test_rows], every[test_rows:]
    sft, train = rest[:sft_rows], rest[sft_rows:sft_rows + train_rows]
    files = {}

    def jsonl(name: str, rows) -> None:
        path = out / name
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        files[name] = path

    def traced(a: int, b: int) -> dict:
        return {"messages": trace(a, b), "tools": [CALCULATOR_SCHEMA]}

    def direct(a: int, b: int) -> dict:
        return {"messages": [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": str(a * b)}],
                "tools": [CALCULATOR_SCHEMA]}

    pick = random.Random(seed + 1)
    jsonl("sft.jsonl", (traced(a, b) if pick.random() < tool_share else direct(a, b) for a, b in sft))
    jsonl("sft-tools.jsonl", (traced(a, b) for a, b in sft))
    jsonl("sft-direct.jsonl", (direct(a, b) for a, b in sft))
    jsonl("train.jsonl", (rl_row(a, b) for a, b in train))
    jsonl("test.jsonl", (rl_row(a, b) for a, b in test))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # the verl files need pyarrow (datasets brings it)
        return files
    for name, split in (("train-verl.parquet", train), ("test-verl.parquet", test)):
        rows = [verl_row(a, b, name.split("-")[0], i) for i, (a, b) in enumerate(split)]
        pq.write_table(pa.Table.from_pylist(rows), out / name)
        files[name] = out / name
    return files


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-rows", type=int, default=20000)
    p.add_argument("--train-rows", type=int, default=20000)
    p.add_argument("--test-rows", type=int, default=1000)
    p.add_argument("--tool-share", type=float, default=0.35, help="share of sft.jsonl's rows that call the tool")
    args = p.parse_args(argv)
    for name, path in write(args.out, seed=args.seed, sft_rows=args.sft_rows, train_rows=args.train_rows,
                            test_rows=args.test_rows, tool_share=args.tool_share).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
