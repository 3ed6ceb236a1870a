"""Bytes before tokens: the longest a text of N tokens can be, so text that may be hostile is measured (in
microseconds) before a tokenizer runs on it (in seconds and gigabytes).

    per_token = longest_token_bytes(tokenizer)         # the vocabulary's longest entry, UTF-8 bytes (at least 4)
    problem = too_long(text, tokens=2048, per_token=per_token, what="prompt 0")   # None, or the refusal

A tokenizer covers a text with entries of its vocabulary, each at most `per_token` bytes of it, so a text of more
than tokens x per_token bytes needs more than `tokens` tokens: it is refused by its length alone. Measured before
this rule (issue 37): one 15 MiB prompt cost the transformers engine 37 s and +4.1 GB before it was found too long
for the context; a 50 MB row cost `rlslurm validate` 115 s and 19.2 GB. The bound is exact for byte-level BPE,
SentencePiece and character vocabularies; a tokenizer that maps a whole unknown run to one <unk> can fit a longer
text in fewer tokens, and such a text is refused all the same (the model would see <unk>s, not the text).
"""

from __future__ import annotations

MIN_TOKEN_BYTES = 4
"""A token covers at least one character, which is up to 4 bytes of UTF-8."""


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the longest entry of `tokenizer`'s vocabulary (added and special tokens included), at least
    MIN_TOKEN_BYTES. Byte-level BPE writes each byte as one character (2 bytes for some, as 'Ġ'), SentencePiece a
    space as '▁' (3 bytes): an entry's UTF-8 length is never less than the text it covers."""
    cached = getattr(tokenizer, "_rlslurm_longest_token_bytes", None)
    if cached is not None:
        return cached
    vocab = tokenizer.get_vocab()
    added = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    longest = max([MIN_TOKEN_BYTES, *(len(entry.encode("utf-8", "surrogatepass")) for entry in [*vocab, *added])])
    try:
        tokenizer._rlslurm_longest_token_bytes = longest
    except AttributeError:  # a tokenizer that takes no attributes: computed each time (a vocabulary pass, ms)
        pass
    return longest


def utf8_bytes(text: str) -> int:
    """len(text.encode()) without building the copy: ASCII is one byte a character, the rest counted."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def too_long(text: str, *, tokens: int, per_token: int, what: str) -> str | None:
    """Why `text` cannot fit in `tokens` tokens of a vocabulary whose longest entry is `per_token` bytes, or None."""
    size, bound = utf8_bytes(text), tokens * per_token
    if size <= bound:
        return None
    return (f"{what} is {megabytes(size)}: more than {tokens} tokens can hold ({megabytes(bound)}, {per_token} "
            f"bytes for the vocabulary's longest token), so it is refused before tokenizing")


def megabytes(size: int) -> str:
    """A byte count as people read it: '512 B', '3.1 KB', '52.4 MB' (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
