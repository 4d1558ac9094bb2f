"""The gateway API's shapes without a gateway: each token's raw bytes (what logprobs
report) spell the text for every family and for a SentencePiece vocabulary, the fast
encoder gives the ids of the transformers tokenizer, and the checker that validates every
answer of the gateway tests (``tests.support.openai_shapes``) refuses what the ``openai``
SDK would let pass. The API through a live gateway is tests/service/test_gateway_api.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from seamlessflow.assets.families import FAMILIES, build_tokenizer, family_spec
from sf_gateway.templating import ChatTokenizer
from tests.support.openai_shapes import check_body
from tests.support.token_texts import SPLIT_TEXT


@pytest.mark.parametrize("family", FAMILIES)
def test_token_bytes_of_every_family_spell_the_text(family: str, tmp_path: Path) -> None:
    build_tokenizer(family_spec(family)).save_pretrained(tmp_path)
    tokenizer = ChatTokenizer(tmp_path)
    text = SPLIT_TEXT + " <tool_call>{}</tool_call>"
    ids = tokenizer.encode_text(text)
    assert len(ids) > len(text.encode()) // 4, "the text is not split into small pieces"
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()


@pytest.mark.parametrize("family", FAMILIES)
def test_encoding_gives_the_ids_of_the_transformers_tokenizer(family: str, tmp_path: Path) -> None:
    """``encode_text`` calls the fast tokenizer's own encoder (cheaper per request): the
    ids are those transformers gives, special tokens, spaces and odd bytes included."""
    build_tokenizer(family_spec(family)).save_pretrained(tmp_path)
    tokenizer = ChatTokenizer(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    texts = [
        tokenizer.render(messages, None, True),
        SPLIT_TEXT + " <tool_call>{}</tool_call>",
        "  leading spaces\n\ttabs\r\n and \u00a0odd\u200b bytes \U0001f642 ",
        tokenizer.end_of_turn + "after the end" + tokenizer.end_of_turn,
        "",
    ]
    for text in texts:
        expected = list(tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokenizer.encode_text(text) == expected, text


def test_token_bytes_of_a_sentencepiece_vocabulary(tmp_path: Path) -> None:
    """SentencePiece-style (Llama 2, Mistral): pieces spell a space as U+2581 and bytes
    without a piece of their own as ``<0xNN>`` (byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", *byte_pieces])
    backend.train_from_iterator(["hello world café, the quick brown fox"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = ChatTokenizer(tmp_path)
    text = "hello 日本 café🙂 world"
    ids = tokenizer.encode_text(text)
    assert ids == list(tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert "<0xE6>" in tokenizer.tokenizer.convert_ids_to_tokens(ids)
    # every piece as written: the one leading space SentencePiece adds included
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == (" " + text).encode()


GOOD_CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "policy",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "4"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
}


def _edited(path: list[Any], value: Any) -> bytes:
    body = json.loads(json.dumps(GOOD_CHAT))
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["created"], "1"),  # a string where an int belongs: the SDK would coerce it
        (["choices", 0, "index"], 0.0),
        (["choices", 0, "finish_reason"], "done"),
        (["choices", 0, "logprobs"], KeyError),  # always sent by OpenAI (null or not)
        (["choices", 0, "message", "content"], KeyError),
        (["choices", 0, "message", "surprise"], 1),  # a field the type does not know
        (["choices", 0, "message", "role"], KeyError),
    ],
)
def test_the_checker_refuses_what_the_sdk_would_let_pass(path: list[Any], value: Any) -> None:
    assert check_body(ChatCompletion, json.dumps(GOOD_CHAT).encode()) == []
    assert check_body(ChatCompletion, _edited(path, value)) != []
