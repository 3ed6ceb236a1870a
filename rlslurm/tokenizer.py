"""The embedded model's tokenizer: one token per character of the arithmetic alphabet, built here.

Nothing comes from a hub: `build_tokenizer()` makes a `tokenizers` word-level model over single characters
(digits, operators, '=', space, and the tool-call brackets) plus <pad>/<s>/</s>/<unk>, and `save_tokenizer(dir)` writes
tokenizer.json + tokenizer_config.json + special_tokens_map.json so that `AutoTokenizer.from_pretrained(dir)`
loads it — which is exactly what vLLM and the HF rollout engine do with an exported model directory.

Encoding adds <s> in front (the post-processor), so a prompt encodes the same whether a trainer or an
engine tokenizes it; generation stops at </s>.

A real pretrained model brings its own tokenizer (rlslurm/models/): `is_embedded(tok)` tells the two
apart, and `save_model_tokenizer(tok, dir)` writes such a one beside an exported model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
# Order fixes the ids: specials 0-3, then the alphabet. Characters are only ever appended (ids 0-18 are the
# first alphabet's): an export made with the shorter one still reads the same (`is_embedded`).
ARITHMETIC = tuple("0123456789") + ("+", "-", "*", "=", " ")
TOOL_CHARS = ("[", "]", "(", ")", "/", ".", "?")
"""The embedded model's tool calls: `[ARG]` a call, `(RESULT)` what the tool said, `?` an error; `/` and `.` for a
calculator's quotients (rlslurm/tools/calls.py EmbeddedFormat). The default model.vocab (32) holds them."""
ALPHABET = ARITHMETIC + TOOL_CHARS
VOCAB = {token: i for i, token in enumerate(SPECIALS + ALPHABET)}
FIRST_VOCAB = len(SPECIALS) + len(ARITHMETIC)
"""Size of the first embedded vocabulary (before the tool characters): exports made with it stay embedded."""
PAD_ID, BOS_ID, EOS_ID = VOCAB[PAD], VOCAB[BOS], VOCAB[EOS]


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ m['content'] or '' }}"
    "{%- for call in m['tool_calls'] or [] -%}[{{ call['function']['arguments'].values() | first }}]{%- endfor -%}"
    "{{ eos_token }}"
    "{%- elif m['role'] == 'user' -%}{{ m['content'] }}="
    "{%- elif m['role'] == 'tool' -%}({{ m['content'] }})"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""The embedded model's chat template, in its own alphabet: a user turn is its text and '=', an assistant turn its
text, its tool calls as `[ARG]` (the call's one argument; there are no letters to name a tool in) and </s>, a tool
turn `(RESULT)`; system turns are left out (no letters to spell them in). The user turn "12*3" renders as
"<s>12*3=", exactly the plain prompt, so chat rows and text rows train the same model; a calculator episode is
"<s>123*45=[123*45]</s>(5535)5535</s>"."""


def build_tokenizer(chat: bool = False) -> PreTrainedTokenizerFast:
    """The character-level tokenizer as a transformers fast tokenizer (left padding, for batched generation);
    `chat`: with CHAT_TEMPLATE (a user's chat dataset on the embedded model; the arithmetic task has none, so
    task.prompt_style = chat still asks for a model of its own)."""
    # Imported here: the CLI reads this module's names (the task's specials) and is ~1 s faster without transformers.
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    # Every character is its own pre-token; the word-level model then maps it to an id (or <unk>).
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                        special_tokens=[(BOS, BOS_ID)])
    # Without Fuse, decoding would join characters with spaces ("1 9" for "19").
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(directory: str | Path, max_length: int | None = None) -> list[Path]:
    """Write the tokenizer files into `directory` (created if missing); returns the paths written.

    `max_length` (the model's max_positions) becomes model_max_length, so loaders truncate where the
    model's positions end instead of at an "infinite" default.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    written = [Path(p) for p in tok.save_pretrained(str(directory))]
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 writes its own class name (TokenizersBackend), which transformers 4.x - still what
    # some vLLM builds pin - does not know; PreTrainedTokenizerFast resolves in both.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if max_length is not None:
        config["model_max_length"] = max_length
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = directory / "special_tokens_map.json"
    special.write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
                                  indent=2) + "\n")
    return sorted(set(written) | {config_path, special})


def is_embedded(tokenizer) -> bool:
    """Whether `tokenizer` is this module's character tokenizer: the same vocabulary id for id, or the first
    FIRST_VOCAB of it (an export made before the tool characters were appended)."""
    vocab = tokenizer.get_vocab()
    return FIRST_VOCAB <= len(vocab) <= len(VOCAB) and vocab == {t: i for t, i in VOCAB.items() if i < len(vocab)}


def save_model_tokenizer(tokenizer, directory: str | Path, max_length: int | None = None) -> None:
    """Write a model's own tokenizer (not the embedded one) into `directory`: tokenizer.json,
    tokenizer_config.json (with its chat template, if any), chat_template.jinja, special_tokens_map.json."""
    directory = Path(directory)
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # As in save_tokenizer: a class name transformers 4.x resolves too. 4.x also looks for the chat
    # template here, 5.x in chat_template.jinja: both hold it.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    config["padding_side"] = "left"
    if max_length is not None:  # as in save_tokenizer
        config["model_max_length"] = max_length
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    specials = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                if getattr(tokenizer, k, None) is not None}
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
