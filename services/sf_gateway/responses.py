"""OpenAI response bodies for finished and streaming choices (chat and legacy completions).

A format turns `Choice`s into JSON-able dicts: the whole response, or the stream's
chunks (what is new in a choice since the last chunk, then its closing chunks). The
streamed text of a choice concatenates to exactly the ``content`` (``text``) of the
equivalent non-streamed response, and its streamed logprobs to its ``logprobs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from seamlessflow.protocol import TopLogprob
from sf_gateway.choice import Choice
from sf_gateway.reasoning import ReasoningParser
from sf_gateway.tool_parsers import ParsedCompletion, ToolCallError, ToolParser

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def logprob_token(raw: bytes) -> str:
    """A token's ``token`` string in chat logprobs: its text if its bytes are whole
    UTF-8 characters, else (part of a character) ``bytes:`` and each byte as ``\\xNN``,
    the form OpenAI and vLLM use; the exact bytes are in ``bytes`` either way."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


@dataclass
class _Format:
    model: str
    token_text: TokenText
    include_usage: bool = False
    token_bytes: TokenBytes | None = None
    """A token's raw bytes (None: the UTF-8 of its decoded text)."""
    prompt_ids: list[int] | None = None
    """vLLM's ``return_token_ids``: the ids the engine was given, returned as
    ``prompt_token_ids`` with each choice's ``token_ids`` (None: not asked for)."""
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def returns_ids(self) -> bool:
        return self.prompt_ids is not None

    def _token_ids(self, chunk: dict[str, Any], choice: Choice, end: int) -> None:
        """The ids ``choice`` generated since its last chunk, into ``chunk`` (asked for)."""
        if self.returns_ids:
            chunk["choices"][0]["token_ids"] = choice.token_ids[choice.sent_tokens : end]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return body

    def _chunk(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(obj, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(
        self, obj: str, prompt_tokens: int, choices: Sequence[Choice]
    ) -> dict[str, Any]:
        body = self._envelope(obj, [])
        body["usage"] = usage(prompt_tokens, choices)
        return body


@dataclass
class ChatFormat(_Format):
    """Chat answers. With a reasoning parser, an answer's reasoning is split off first
    (``reasoning_content``), then the tool parser reads calls from the rest. Streamed,
    reasoning deltas come first, then content; text that may become a tool call is held
    until the answer is complete, then each call is sent as OpenAI streams them (its
    index, id and name with empty arguments, then the arguments)."""

    parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    reasoning_opened: bool = False
    """The prompt opened the reasoning block (it ends with the parser's ``start``): the
    answer is read as if it began with it."""
    logprobs: bool = False
    tool_names: frozenset[str] | None = None
    """The functions the request offered (None: calls are not checked against them); a
    call of another is returned as written, with an ``unknown_tool`` error."""
    _parsed: dict[int, ParsedCompletion] = field(default_factory=dict)
    _sent_reasoning: dict[int, int] = field(default_factory=dict)
    """Characters of each choice's reasoning streamed so far (its content's are
    ``Choice.sent_chars``)."""

    def __post_init__(self) -> None:
        self.id = self.id or "chatcmpl-" + uuid.uuid4().hex

    # -- whole response ----------------------------------------------------------------
    def parsed(self, choice: Choice) -> ParsedCompletion:
        """The finished choice's reasoning, content and tool calls (parsed once: call
        ids are stable)."""
        if choice.index not in self._parsed:
            reasoning, rest = (None, choice.text)
            if self.reasoning is not None:
                reasoning, rest = self.reasoning.split(self._opened(choice.text))
            if self.parser is not None:
                parsed = self.parser.parse(rest)
                errors = parsed.errors + tuple(
                    ToolCallError("unknown_tool", f"no function {call.name!r} was offered", call.id)
                    for call in parsed.tool_calls
                    if self.tool_names is not None and call.name not in self.tool_names
                )
                parsed = replace(parsed, reasoning=reasoning, errors=errors)
            else:
                content = None if reasoning is not None and not rest else rest
                parsed = ParsedCompletion(content, [], reasoning)
            self._parsed[choice.index] = parsed
        return self._parsed[choice.index]

    def tool_call_errors(self, choice: Choice) -> dict[str, Any]:
        """The choice's ``tool_call_errors`` field: the malformed calls of its answer
        (empty: none, and no field)."""
        errors = self.parsed(choice).errors
        return {"tool_call_errors": [e.body() for e in errors]} if errors else {}

    def message(self, choice: Choice) -> dict[str, Any]:
        parsed = self.parsed(choice)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in parsed.tool_calls
            ]
        return message

    def finish_reason(self, choice: Choice) -> str:
        parsed = self.parsed(choice)
        if parsed.tool_calls:
            if parsed.unfinished and choice.finish_reason == "length":
                return "length"  # as OpenAI says of a call cut by max_tokens
            return "tool_calls"
        return "stop" if choice.finish_reason == "stop" else "length"

    def response(self, prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, Any]:
        body = self._envelope(
            "chat.completion",
            [
                {
                    "index": c.index,
                    "message": self.message(c),
                    "finish_reason": self.finish_reason(c),
                    "logprobs": self._logprobs(c, 0) if self.logprobs else None,
                    **({"token_ids": list(c.token_ids)} if self.returns_ids else {}),
                    **self.tool_call_errors(c),
                }
                for c in choices
            ],
        )
        if self.returns_ids:
            body["prompt_token_ids"] = self.prompt_ids
        body["usage"] = usage(prompt_tokens, choices)
        return body

    # -- stream ------------------------------------------------------------------------
    def opening(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        chunks = [self._delta(c, {"role": "assistant", "content": ""}) for c in choices]
        if chunks and self.returns_ids:  # in the first chunk only, as vLLM sends them
            chunks[0]["prompt_token_ids"] = self.prompt_ids
        return chunks

    def _pending_tokens(self, choice: Choice) -> bool:
        """Ids generated since the last chunk that the client asked to see."""
        tracked = self.logprobs or self.returns_ids
        return tracked and choice.sent_tokens < len(choice.token_ids)

    def streamable(self, choice: Choice) -> tuple[str, str]:
        """The prefixes of the choice's reasoning and content that are final now."""
        text = choice.safe_text()
        reasoning, rest = "", text
        if self.reasoning is not None:
            reasoning, rest_or_none = self.reasoning.streamable(self._opened(text))
            rest = rest_or_none or ""
        if self.parser is not None:
            rest = self.parser.streamable(rest)
        return reasoning, rest

    def _opened(self, text: str) -> str:
        if self.reasoning is not None and self.reasoning_opened:
            return self.reasoning.start + text
        return text

    def progress(self, choice: Choice) -> dict[str, Any] | None:
        """What is new and final in ``choice`` since the last chunk, if anything."""
        reasoning, content = self.streamable(choice)
        new_reasoning = reasoning[self._sent_reasoning.get(choice.index, 0) :]
        new_content = content[choice.sent_chars :]
        if not new_reasoning and not new_content and not self._pending_tokens(choice):
            return None
        return self._advance(choice, new_reasoning, new_content, len(choice.token_ids))

    def closing(self, choice: Choice) -> list[dict[str, Any]]:
        parsed = self.parsed(choice)
        chunks = []
        reasoning = (parsed.reasoning or "")[self._sent_reasoning.get(choice.index, 0) :]
        rest = (parsed.content or "")[choice.sent_chars :]
        if reasoning or rest or self._pending_tokens(choice):
            chunks.append(self._advance(choice, reasoning, rest, len(choice.token_ids)))
        for index, call in enumerate(self.message(choice).get("tool_calls", [])):
            function = call["function"]
            opening = {**call, "function": {"name": function["name"], "arguments": ""}}
            arguments = {"index": index, "function": {"arguments": function["arguments"]}}
            chunks.append(self._delta(choice, {"tool_calls": [{"index": index, **opening}]}))
            chunks.append(self._delta(choice, {"tool_calls": [arguments]}))
        closing = self._delta(choice, {}, finish_reason=self.finish_reason(choice))
        closing["choices"][0].update(self.tool_call_errors(choice))
        chunks.append(closing)
        return chunks

    def _advance(self, choice: Choice, reasoning: str, text: str, tokens_to: int) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text or not reasoning:
            delta["content"] = text
        chunk = self._delta(choice, delta)
        if self.logprobs:
            chunk["choices"][0]["logprobs"] = self._logprobs(choice, choice.sent_tokens, tokens_to)
        self._token_ids(chunk, choice, tokens_to)
        self._sent_reasoning[choice.index] = self._sent_reasoning.get(choice.index, 0) + len(
            reasoning
        )
        choice.sent_chars += len(text)
        choice.sent_tokens = tokens_to
        return chunk

    def _delta(
        self, choice: Choice, delta: dict[str, Any], finish_reason: str | None = None
    ) -> dict[str, Any]:
        return self._chunk(
            "chat.completion.chunk",
            {
                "index": choice.index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                **({"token_ids": []} if self.returns_ids else {}),
            },
        )

    def _logprobs(self, choice: Choice, start: int, end: int | None = None) -> dict[str, Any]:
        rows = zip(choice.token_ids, choice.logprobs, choice.top_logprobs, strict=True)
        return {
            "content": [
                {
                    **self._entry(token, logprob),
                    "top_logprobs": [self._entry(t.token_id, t.logprob) for t in top],
                }
                for token, logprob, top in list(rows)[start:end]
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        if self.token_bytes is not None:
            raw = self.token_bytes(token_id)
        else:
            raw = self.token_text(token_id).encode()
        return {"token": logprob_token(raw), "logprob": logprob, "bytes": list(raw)}


@dataclass
class CompletionFormat(_Format):
    logprobs: int | None = None
    """None: no logprobs; k >= 0: each token's logprob and its k most likely tokens."""
    _opened: set[int] = field(default_factory=set)
    """Choices that sent a chunk (the first one carries the prompt's ids)."""

    def __post_init__(self) -> None:
        self.id = self.id or "cmpl-" + uuid.uuid4().hex

    def response(self, prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, Any]:
        body = self._envelope(
            "text_completion",
            [
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": _finish(c),
                    "logprobs": self._logprobs(c, 0, None),
                    **(
                        {"prompt_token_ids": self.prompt_ids, "token_ids": list(c.token_ids)}
                        if self.returns_ids
                        else {}
                    ),
                }
                for c in choices
            ],
        )
        body["usage"] = usage(prompt_tokens, choices)
        return body

    def opening(self, choices: Sequence[Choice]) -> list[dict[str, Any]]:
        return []

    def progress(self, choice: Choice) -> dict[str, Any] | None:
        text = choice.safe_text()[choice.sent_chars :]
        tracked = self.logprobs is not None or self.returns_ids
        if not text and not (tracked and choice.sent_tokens < len(choice.token_ids)):
            return None
        return self._advance(choice, text, None)

    def closing(self, choice: Choice) -> list[dict[str, Any]]:
        chunk = self._advance(choice, choice.text[choice.sent_chars :], _finish(choice))
        return [chunk]

    def _advance(self, choice: Choice, text: str, finish_reason: str | None) -> dict[str, Any]:
        end = len(choice.token_ids)
        chunk = self._chunk(
            "text_completion",
            {
                "index": choice.index,
                "text": text,
                "logprobs": self._logprobs(choice, choice.sent_tokens, end),
                "finish_reason": finish_reason,
            },
        )
        self._token_ids(chunk, choice, end)
        if self.returns_ids and choice.index not in self._opened:
            # a choice's prompt ids come with its first chunk, as vLLM sends them
            chunk["choices"][0]["prompt_token_ids"] = self.prompt_ids
            self._opened.add(choice.index)
        choice.sent_chars += len(text)
        choice.sent_tokens = end
        return chunk

    def _logprobs(self, choice: Choice, start: int, end: int | None) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in choice.token_ids[start:end]]
        offsets, offset = [], sum(len(self.token_text(t)) for t in choice.token_ids[:start])
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        tops: list[list[TopLogprob]] = choice.top_logprobs[start:end]
        return {
            "tokens": tokens,
            "token_logprobs": choice.logprobs[start:end],
            "top_logprobs": [{self.token_text(t.token_id): t.logprob for t in top} for top in tops]
            if self.logprobs
            else None,
            "text_offset": offsets,
        }


def _finish(choice: Choice) -> str:
    return "stop" if choice.finish_reason == "stop" else "length"
