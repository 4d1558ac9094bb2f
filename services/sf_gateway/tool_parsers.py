"""Tool-call parsers: turn a completion's text into OpenAI ``tool_calls``, per model family.

A parser is a small class registered by name; ``SF_GATEWAY_TOOL_PARSER`` picks one, or
``auto`` picks it from the model's chat template (``tool_parser_for``). Another family
adds its own with ``@register_tool_parser("name")``.

- ``hermes`` (alias ``qwen``; Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks anywhere in the answer, text around them is
  content.
- ``llama3_json`` (Llama 3.1/3.2): the whole answer is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``, optionally after
  ``<|python_tag|>`` (a special token, which the decoded text usually no longer holds).
  What the family's template renders for an assistant's tool call is exactly that JSON,
  so a parsed call sent back renders as the model wrote it.

Contract of ``parse(text)``: every well-formed call becomes a ``ToolCall`` (arguments as
a JSON string), and the content is the text outside the calls, ``None`` if that is empty
or only whitespace. A call the model wrote malformed is never silently dropped: the
parser also returns a ``ToolCallError`` for it (``ParsedCompletion.errors``), and what
the agent gets is what OpenAI documents for function calling without strict mode:

- ``invalid_json`` (the block is not JSON: broken, or cut by the token budget) and
  ``invalid_arguments`` (JSON, but its arguments are no object): when the function's
  name can be read, the call is returned with that name and its arguments exactly as
  the model wrote them (text that may not parse, which the agent checks, as OpenAI
  asks of every client, and answers with a ``tool`` message);
- ``no_name`` (no function name to read): the block stays in the content.

The gateway adds ``unknown_tool`` for a call of a function the request did not offer
(returned as written, like OpenAI's). The errors are returned with the choice
(``tool_call_errors``), recorded with the turn and counted in the batch reports
(docs/environments.md, "Malformed tool calls").

Contract of ``streamable(text)`` (``text``: a prefix of the answer): the prefix of
``text`` that may be streamed as content now, i.e. that is a prefix of the content of
every answer starting with ``text``. Text that may become a tool call is held back
until the answer is complete and parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from seamlessflow.plugins import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON object, serialised (what OpenAI sends)."""
    id: str


TOOL_CALL_ERROR_KINDS = ("invalid_json", "invalid_arguments", "no_name", "unknown_tool")
"""What ``ToolCallError.kind`` may say (see the module's doc)."""


@dataclass(frozen=True)
class ToolCallError:
    """A tool call the model wrote malformed (or of a function not offered)."""

    kind: str
    """One of ``TOOL_CALL_ERROR_KINDS``."""
    message: str
    tool_call_id: str | None = None
    """The returned call it concerns; None: the block stayed in the content."""

    def body(self) -> dict[str, Any]:
        """As the choice's ``tool_call_errors`` lists it."""
        return {"type": self.kind, "message": self.message, "tool_call_id": self.tool_call_id}


@dataclass(frozen=True)
class ParsedCompletion:
    content: str | None
    tool_calls: list[ToolCall]
    reasoning: str | None = None
    """A thinking model's reasoning (``reasoning_content``), split off by a reasoning
    parser (``sf_gateway.reasoning``); None: none."""
    errors: tuple[ToolCallError, ...] = ()
    """The calls the model wrote malformed, in order."""
    unfinished: bool = False
    """The last call was opened and never closed (cut by the token budget, or the model
    stopped): with ``finish_reason`` "length" the answer says "length", as OpenAI does."""


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedCompletion: ...

    def streamable(self, text: str) -> str: ...


class ForcesCalls(Protocol):
    """A parser that can also write the opening of a call, for a forced ``tool_choice``
    (its ``parse`` reads the answer as opening + what the model wrote, finished or not)."""

    def call_opening(self, name: str | None) -> str:
        """The text that opens a call of ``name`` up to its arguments (None: up to the
        function's name, which the model writes)."""
        ...


TOOL_PARSERS: Registry[Callable[[], ToolParser]] = Registry("tool parser", "SF_GATEWAY_TOOL_PARSER")


register_tool_parser = TOOL_PARSERS.register


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; UnknownPlugin (listing the known ones) if none."""
    return TOOL_PARSERS.get(name)()


def tool_parser_for(setting: str, chat_template: str, model_type: str = "") -> ToolParser | None:
    """The parser ``setting`` names; ``auto``: the one the chat template writes tool
    calls in (``<tool_call>`` blocks: hermes; Llama 3 headers or a ``"parameters"`` JSON
    call: llama3_json), else by the config's ``model_type``, else hermes. ``none``: tool
    calls are not parsed (answers stay text)."""
    if setting == "none":
        return None
    if setting != "auto":
        return get_tool_parser(setting)
    if "<tool_call>" in chat_template:
        return get_tool_parser("hermes")
    if "<|start_header_id|>" in chat_template or "<|python_tag|>" in chat_template:
        return get_tool_parser("llama3_json")
    if model_type.startswith("llama"):
        return get_tool_parser("llama3_json")
    return get_tool_parser("hermes")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@register_tool_parser("qwen")
@register_tool_parser("hermes")
class QwenToolParser:
    """Qwen2.5 / Qwen3 / Hermes style:
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    start_marker: ClassVar[str] = "<tool_call>"
    end_marker: ClassVar[str] = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>|<tool_call>\s*(.*?)\s*\Z", re.S)
    _NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
    _ARGUMENTS = re.compile(r'"arguments"\s*:\s*')

    def call_opening(self, name: str | None) -> str:
        # as Qwen2.5's chat template writes an assistant's tool call, cut before a space
        # (a trailing space would be a token of its own, where the model writes " {")
        if name is None:
            return '<tool_call>\n{"name": "'
        return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'

    def parse(self, text: str) -> ParsedCompletion:
        """Every ``<tool_call>`` block, closed or (the last one) not, as vLLM's hermes
        parser reads them; a malformed one as the module's doc says."""
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        outside: list[str] = []
        position = 0
        unfinished = False
        for match in self._BLOCK.finditer(text):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            call, error = self._call(body)
            if error is not None:
                errors.append(error)
            if call is None:
                continue  # no name: the block stays part of the content
            outside.append(text[position : match.start()])
            position = match.end()
            calls.append(call)
            unfinished = match.group(1) is None
        outside.append(text[position:])
        content = "".join(outside)
        return ParsedCompletion(
            content if content.strip() else None, calls, errors=tuple(errors),
            unfinished=unfinished,
        )  # fmt: skip

    def _call(self, body: str) -> tuple[ToolCall | None, ToolCallError | None]:
        """The call one block holds, and what is wrong with it (None: nothing)."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            name = self._written_name(body)
            if name is None:
                return None, ToolCallError("no_name", f"the tool call is not JSON ({exc})")
            loose = ToolCall(name, self._written_arguments(body), new_call_id())
            return loose, ToolCallError(
                "invalid_json", f"the call of {name!r} is not JSON ({exc})", loose.id
            )
        well_formed = _call_from_obj(value)
        if well_formed is not None:
            return well_formed, None
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str) or not name:
            return None, ToolCallError("no_name", "the tool call names no function")
        arguments = value.get("arguments")
        written = arguments if isinstance(arguments, str) else json.dumps(arguments)
        call = ToolCall(name, written, new_call_id())
        return call, ToolCallError(
            "invalid_arguments", f"the arguments of {name!r} are not a JSON object", call.id
        )

    def _written_name(self, body: str) -> str | None:
        written = self._NAME.search(body)
        if written is None:
            return None
        try:
            name = json.loads(written.group(1))
        except json.JSONDecodeError:  # an escape JSON does not know: no name to give
            return None
        return name if isinstance(name, str) and name else None

    def _written_arguments(self, body: str) -> str:
        """The arguments as the model wrote them: the JSON value after ``"arguments":``
        if one is complete, else the text after it as it stands ("" if none)."""
        opened = self._ARGUMENTS.search(body)
        if opened is None:
            return ""
        raw = body[opened.end() :]
        try:
            _, end = json.JSONDecoder().raw_decode(raw)
        except json.JSONDecodeError:
            return raw.rstrip()
        return raw[:end]

    def streamable(self, text: str) -> str:
        marker = text.find(self.start_marker)
        text = text[:marker] if marker >= 0 else drop_partial(text, [self.start_marker])
        return text if text.strip() else ""  # whitespace alone may be no content at all


HermesToolParser = QwenToolParser


@register_tool_parser("llama3_json")
class Llama3JsonToolParser:
    """Llama 3.1/3.2 JSON calls: the answer is ``{"name": ..., "parameters": {...}}``
    (``"arguments"`` is accepted too), several separated by ``;``, optionally after
    ``<|python_tag|>``. Anything else, or any malformed part, is content as a whole."""

    python_tag: ClassVar[str] = "<|python_tag|>"
    _CALL_START = re.compile(r'\{\s*"name"\s*:')

    def parse(self, text: str) -> ParsedCompletion:
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag) :].lstrip()
        calls = self._calls(body) if body.startswith("{") else None
        if calls:
            return ParsedCompletion(None, calls)
        errors: tuple[ToolCallError, ...] = ()
        if text.lstrip().startswith(self.python_tag) or self._CALL_START.match(body):
            # meant as a call (the tag, or a JSON object naming a function) and not one:
            # the answer stays content, since this format has no block to cut a call from
            errors = (ToolCallError("invalid_json", "the answer opens a tool call that does "
                                    "not parse as this family's JSON calls"),)  # fmt: skip
        return ParsedCompletion(text if text.strip() else None, [], errors=errors)

    def streamable(self, text: str) -> str:
        body = text.lstrip()
        if not body or body.startswith(("{", self.python_tag)) or self.python_tag.startswith(body):
            return ""  # may still become (or is) a call: held until the answer is parsed
        return text

    @staticmethod
    def _calls(body: str) -> list[ToolCall] | None:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        position = 0
        while True:
            try:
                obj, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return None
            if isinstance(obj, dict) and "arguments" not in obj and "parameters" in obj:
                obj = {"name": obj.get("name"), "arguments": obj["parameters"]}
            call = _call_from_obj(obj)
            if call is None:
                return None
            calls.append(call)
            rest = body[position:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            rest = rest[1:].lstrip()
            position = len(body) - len(rest)


def drop_partial(text: str, markers: list[str] | tuple[str, ...]) -> str:
    """``text`` without its longest tail that is a proper prefix of one of ``markers``."""
    for length in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-length:]
        if any(m.startswith(tail) for m in markers):
            return text[:-length]
    return text


def _call_from_json(body: str) -> ToolCall | None:
    """``{"name": str, "arguments": object}`` (arguments may also be a JSON string of an
    object, or absent); anything else is not a call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_from_obj(call)


def _call_from_obj(call: Any) -> ToolCall | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())
