"""Tokenization at the gateway: the chat template is applied here and only here.

Engines and the trainer only ever see token ids; text exists at the agent boundary.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from seamlessflow.assets.model_check import config_ids
from seamlessflow.assets.tokenizer import load_tokenizer

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A SentencePiece byte-fallback piece: one raw byte."""
METASPACE = "\u2581"


class ChatTokenizer:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(model_dir)
        # the chat's end of turn, padding, and the model's own eos ids (a base model given
        # a chat template, such as Gemma 3 270M, may still end a document on its eos)
        stops = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
        stops |= config_ids(Path(model_dir), None, "eos_token_id")  # generation_config.json's
        for special in ("<|im_end|>", "<|endoftext|>"):
            token_id = self.tokenizer.convert_tokens_to_ids(special)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                stops.add(token_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(t for t in stops if t is not None))
        self.vocab_size = len(self.tokenizer)
        self._added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()}
        # Byte-level BPE (GPT-2, Qwen, Llama 3) spells each byte as one printable
        # character; a vocabulary whose every piece is in that alphabet is byte-level.
        alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
        pieces = [p for p, i in self.tokenizer.get_vocab().items() if i not in self._added]
        byte_level = all(char in alphabet for piece in pieces for char in piece)
        self._byte_of: dict[str, int] | None = alphabet if byte_level else None
        # SentencePiece spells a space as U+2581 and bytes without a piece as <0xNN>
        self._metaspace = not byte_level and any(METASPACE in piece for piece in pieces)
        self._bytes: dict[int, bytes] = {}
        template = self.tokenizer.chat_template
        self.chat_template: str = template if isinstance(template, str) else ""
        """The default chat template's source (tool and reasoning parsers are picked
        from its markers)."""
        self.model_type = _model_type(model_dir)
        # A fast tokenizer's own encoder gives the ids transformers' ``__call__`` gives
        # (``tests/unit/test_gateway_api_shapes.py``), without its per-call Python bookkeeping.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._backend_encode = backend.encode if self.tokenizer.is_fast and backend else None

    @property
    def end_of_turn(self) -> str:
        """The token text that ends an assistant turn (the chat eos, e.g. ``<|im_end|>``)."""
        return str(self.tokenizer.eos_token)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        """The chat template's text for ``messages`` (no tokenization)."""
        return str(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools,  # type: ignore[arg-type]  # transformers' stub wants dict[Any, Any]
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Template the conversation and open an assistant turn."""
        return self.encode_text(self.render(messages, None, True))

    def encode_text(self, text: str) -> list[int]:
        if self._backend_encode is not None:
            return list(self._backend_encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_completion(self, token_ids: list[int]) -> str:
        """The text an agent sees: without a trailing stop token."""
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def raw_text(self, token_ids: list[int]) -> str:
        """The ids decoded with special tokens kept (what the engine literally produced)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for: a token may hold part of a multi-byte
        UTF-8 character, which decoding it alone would turn into U+FFFD. The bytes of a
        completion's tokens concatenate to the UTF-8 of its text."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = str(self.tokenizer.convert_ids_to_tokens(token_id))
        if self._metaspace:
            fallback = BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        if self._byte_of is not None:
            return bytes(self._byte_of[char] for char in piece)
        if self._metaspace:  # the piece as written (a leading space included)
            return piece.replace(METASPACE, " ").encode()
        # other vocabularies: the token's text is whole characters
        return self.token_text(token_id).encode()


def _model_type(model_dir: Path) -> str:
    """``model_type`` of the directory's config.json ("" without one)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""
