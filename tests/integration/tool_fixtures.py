"""A model that calls tools on cue, for the multi-turn episode tests: a tiny Llama with a character tokenizer
over printable ASCII (so it can write Hermes' `<tool_call>{json}</tool_call>`) and a chat template of that
format, trained here in seconds to play given conversations greedily, token for token.

    path = scripted_model(tmp / "m", {"twice": [...turns...]})     # an HF directory an engine and a trainer load

Its template is Qwen's shape in ASCII: `U:question\\n`, an assistant turn `A:` + content + one
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` per call + `</s>` and a newline *after* the
end-of-turn token (what the template writes and the model does not), a tool turn `T:result\\n`; so the
episode code meets the same pieces as on Qwen: a generation prompt, a template newline after </s>, tool turns.
Nothing here fakes an engine: the engines are the real servers, the trainer the real policy.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII and \n
TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}U:{{ m['content'] }}{{ '\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}A:{{ m['content'] or '' }}"
    "{%- for call in m['tool_calls'] or [] -%}<tool_call>{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}</tool_call>{%- endfor -%}</s>{{ '\\n' }}"
    "{%- elif m['role'] == 'tool' -%}T:{{ m['content'] }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:{%- endif -%}"
)


def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")
    fast.chat_template = TEMPLATE
    return fast


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def scripted_model(path: Path, conversations: dict[str, list[dict]], *, hidden: int = 128, seed: int = 0,
                   max_steps: int = 1500) -> Path:
    """An HF directory whose model plays `conversations` greedily: {question: the turns after it (assistant
    turns with tool_calls, tool turns, the final assistant turn)}. Trained on their model turns only (the
    labels SFT uses: rlslurm/data/tokens.py encode_turns) until every one of their tokens is its argmax."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlslurm.data.sample import Sample
    from rlslurm.data.tokens import IGNORE, encode_turns
    from rlslurm.tokenizer import save_model_tokenizer

    tok = tokenizer()
    rows = [encode_turns(tok, Sample(prompt=[{"role": "user", "content": q}], turns=turns))
            for q, turns in conversations.items()]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), 0)
    labels = torch.full((len(rows), width), IGNORE)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)] = torch.tensor(x), torch.tensor(y)
    config = LlamaConfig(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max(256, 2 * width), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    target = labels[:, 1:]
    for step in range(max_steps):
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24:
            with torch.no_grad():
                pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
            learned = target != IGNORE
            # every learned token the argmax by a margin: greedy decoding plays the script exactly
            if bool((pred[learned] == target[learned]).all()) and float(loss.detach()) < 0.02:
                break
    else:
        raise AssertionError(f"the scripted model did not learn its {len(rows)} conversations in {max_steps} steps "
                             f"(loss {float(loss.detach()):.3f})")
    model.eval()
    model.generation_config.eos_token_id = 2
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_model_tokenizer(tok, path)
    (path / "conversations.json").write_text(json.dumps(conversations))
    return path
