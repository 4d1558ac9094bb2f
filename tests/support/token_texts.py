"""Texts and ids for the tests of tokenization and conversations: ``SPLIT_TEXT``, whose
non-ASCII characters are split across tokens, and ``engine_output``, the ids an engine
might produce for a text (not necessarily its canonical tokenization)."""

from __future__ import annotations

SPLIT_TEXT = "日本語 🙂 café ü"
"""Every non-ASCII character here is several tokens of the base tokenizer (a byte each)."""


def engine_output(
    tokenizer, text: str, *, stop: bool = True, char_by_char: bool = False
) -> list[int]:  # type: ignore[no-untyped-def]
    """Ids as an engine might produce them: not necessarily the canonical tokenization."""
    if char_by_char:
        ids = [tokenizer.convert_tokens_to_ids(t) for c in text for t in tokenizer.tokenize(c)]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")] if stop else list(ids)
