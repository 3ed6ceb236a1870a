"""Write the small example datasets of examples/sft-jsonl.yaml and examples/sft-chat.yaml (committed; this
script makes them again, the same bytes every time):

    python examples/data/make_examples.py      # -> examples/data/mul-prompt-completion.jsonl, mul-messages.jsonl

Single-digit multiplication in the embedded tiny model's alphabet (digits, '*', '='), so both run on the
embedded default: TRL's prompt/completion form ({"prompt": "7*8=", "completion": "56"}) and its
conversational form ({"messages": [{"role": "user", "content": "7*8"}, {"role": "assistant", ...}]}),
rendered by the embedded chat template ("<s>7*8=" then "56</s>": rlslurm/tokenizer.py's CHAT_TEMPLATE).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


def main() -> None:
    with (HERE / "mul-prompt-completion.jsonl").open("w") as f:
        for a, b in rows():
            f.write(json.dumps({"prompt": f"{a}*{b}=", "completion": str(a * b)}) + "\n")
    with (HERE / "mul-messages.jsonl").open("w") as f:
        for a, b in rows():
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}*{b}"},
                                             {"role": "assistant", "content": str(a * b)}]}) + "\n")


if __name__ == "__main__":
    main()
