"""``POST /s/<session>/v1/responses``: the OpenAI Responses API, as chat turns.

Over 400 lines: the request model, its translation to chat and the event stream are one API.

The subset the OpenAI Agents SDK (``OpenAIResponsesModel``) and the ``openai`` client
use: ``input`` (a string, or items: messages of role user/system/developer/assistant,
``function_call`` and ``function_call_output`` items), ``instructions``, function
``tools``, ``tool_choice``, ``parallel_tool_calls``, ``temperature``, ``top_p``,
``max_output_tokens``, ``text.format``, ``stream``, ``store``, ``metadata`` and an
empty ``include``. Any other field, item type, content part or tool type is a 400
that names it; nothing is stored then.

A request becomes a chat completion request (``instructions`` a leading system
message; a ``function_call`` item joins the assistant message before it as a tool
call; a ``function_call_output`` item is a ``tool`` message) and runs as a chat turn
through ``TurnPlanner.chat_turn`` and ``TurnRunner``, as chat completions do: same
template, same session tree, same engine loop, same ``TurnRecorded``. The output a turn
answers with converts back to exactly the assistant message the tree recorded, so an
agent that sends its items back continues its branch (token ids reused, never
re-tokenized).

``previous_response_id`` (and ``conversation``) are refused: responses are not kept
for retrieval; the Agents SDK sends the full input by default, as does any agent that
keeps its own history. ``store`` is accepted either way: every turn is recorded in the
session regardless, and no response can be fetched back by id.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sf_gateway.choice import Choice
from sf_gateway.openai_api import ApiError, ChatCompletionRequest
from sf_gateway.request_body import read_json
from sf_gateway.responses import ChatFormat
from sf_gateway.sse import turn_updates

if TYPE_CHECKING:
    import asyncio

    from sf_gateway.sessions import GatewaySession
    from sf_gateway.turn_runner import TurnRunner
    from sf_gateway.turns import Turn, TurnPlanner


class FunctionToolIn(BaseModel):
    """A Responses function tool (``strict`` is accepted and not enforced: arguments
    are sampled freely and parsed as JSON, as for chat tools)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The fields accepted; any other is refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise ApiError(
                400,
                "previous_response_id is not supported: responses are not kept; send the "
                "whole conversation as input (the OpenAI Agents SDK does by default)",
                param="previous_response_id",
            )
        if self.include:
            raise ApiError(400, f"include {self.include} is not supported", param="include")

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat completion request (validated as one by the caller)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages()}
        if self.stream:
            body["stream"] = True
        if self.tools:
            body["tools"] = [tool.for_chat() for tool in self.tools]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        for name, value in (
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("max_completion_tokens", self.max_output_tokens),
        ):
            if value is not None:
                body[name] = value
        # These two are chat parameters only where chat completions honour them; until
        # then they are refused here rather than silently dropped.
        if self.parallel_tool_calls is not None:
            _needs_chat_field("parallel_tool_calls", "parallel_tool_calls")
            body["parallel_tool_calls"] = self.parallel_tool_calls
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            _needs_chat_field("response_format", "text.format")
            if text_format.type == "json_object":
                body["response_format"] = {"type": "json_object"}
            else:
                schema: dict[str, Any] = {
                    "name": text_format.name or "response",
                    "schema": text_format.schema_,
                }
                if text_format.description is not None:
                    schema["description"] = text_format.description
                if text_format.strict is not None:
                    schema["strict"] = text_format.strict
                body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return body

    def messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for index, item in enumerate(self.input):
            messages.extend(_item_message(item, f"input[{index}]", messages))
        return messages


def _needs_chat_field(chat_field: str, param: str) -> None:
    if chat_field not in ChatCompletionRequest.model_fields:
        raise ApiError(400, f"{param} is not supported yet", param=param)


_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"input_text", "output_text"}


def _item_message(item: Any, where: str, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat message an input item adds (none if it joins the message before it)."""
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            message = f"{where}.role must be one of {list(_ROLES)}"
            raise ApiError(400, message, param=f"{where}.role")
        return [{"role": role, "content": _text(item.get("content"), f"{where}.content")}]
    if kind == "function_call":
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _string(item, "name", where),
                "arguments": _string(item, "arguments", where, empty=True),
            },
        }
        previous = before[-1] if before else None
        if previous is not None and previous["role"] == "assistant":
            # calls of one answer follow its message (if it had text): one chat message
            previous.setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        return [
            {
                "role": "tool",
                "tool_call_id": _string(item, "call_id", where),
                "content": _text(item.get("output"), f"{where}.output"),
            }
        ]
    raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", param=where)


def _string(item: dict[str, Any], key: str, where: str, *, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise ApiError(400, f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (other parts: a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of parts", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"{where}[{index}]: content parts of type {kind!r} are not supported "
                f"(only {sorted(_TEXT_PARTS)})",
                param=f"{where}[{index}]",
            )
        texts.append(part["text"])
    return "".join(texts)


_CHAT_TO_RESPONSES = {"max_completion_tokens": "max_output_tokens", "messages": "input"}


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        parts = [str(part) for part in first["loc"]]
        if parts and model is ChatCompletionRequest:
            # chat message indexes are not input item indexes: name the input only
            parts = [_CHAT_TO_RESPONSES.get(parts[0], parts[0])] + (
                [] if parts[0] == "messages" else parts[1:]
            )
            if parts[0] == "tools" and parts[2:3] == ["function"]:
                del parts[2]  # a chat tool's function fields are a Responses tool's own
        param = ".".join(parts) or None
        if first["type"] == "extra_forbidden":
            message = f"{param} is not supported by this gateway's Responses API"
        else:
            message = f"{param}: {first['msg']}" if param else first["msg"]
        raise ApiError(400, message, param=param) from None


async def create_response(
    request: Request, session: GatewaySession, planner: TurnPlanner, runner: TurnRunner
) -> Response:
    """The Response to ``request``, a turn of ``session`` (open, its key checked)
    planned by ``planner`` as a chat turn and run (or streamed) by ``runner``."""
    body: ResponsesRequest = _parse(ResponsesRequest, await read_json(request))
    body.check()
    chat: ChatCompletionRequest = _parse(ChatCompletionRequest, body.chat_body())
    turn, view = planner.chat_turn(session, chat, "gateway.response")
    answer = ResponseView(body, chat, view, turn)
    if body.stream:
        return runner.stream(turn, view, events=answer.events)
    await runner.run(turn)
    return JSONResponse(answer.response("final"))


class ResponseView:
    """The Response object of one turn (its single choice) and its stream of events."""

    def __init__(
        self, body: ResponsesRequest, chat: ChatCompletionRequest, view: ChatFormat, turn: Turn
    ) -> None:
        self.body = body
        self.chat = chat
        self.view = view
        self.turn = turn
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex
        self.sequence = 0

    @property
    def choice(self) -> Choice:
        return self.turn.choices[0]

    # -- the Response object -----------------------------------------------------------
    def _incomplete(self) -> bool:
        cut = self.choice.finish_reason == "length"
        return cut and not self.view.parsed(self.choice).tool_calls

    def response(self, stage: Literal["started", "final"]) -> dict[str, Any]:
        final = stage == "final"
        status = ("incomplete" if self._incomplete() else "completed") if final else "in_progress"
        body = self.body
        tool_choice: Any = body.tool_choice or "auto"
        if isinstance(tool_choice, ToolChoiceFunction):
            tool_choice = tool_choice.model_dump()
        answer: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": body.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if final and status == "incomplete"
            else None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "output": self.output() if final else [],
            "parallel_tool_calls": True
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            "temperature": self.chat.temperature,
            "top_p": self.chat.top_p,
            "max_output_tokens": body.max_output_tokens,
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "previous_response_id": None,
            "text": {"format": {"type": "text"}}
            if body.text is None or body.text.format is None
            else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
            "truncation": "disabled",
            "usage": self.usage() if final else None,
        }
        return answer

    def usage(self) -> dict[str, Any]:
        prompt = len(self.turn.plan.prompt_ids)
        completion = len(self.choice.token_ids)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }

    def output(self) -> list[dict[str, Any]]:
        parsed = self.view.parsed(self.choice)
        items: list[dict[str, Any]] = []
        if parsed.content is not None:
            items.append(self._message(parsed.content, self._item_status()))
        items.extend(self._call(call, "completed") for call in parsed.tool_calls)
        return items

    def _item_status(self) -> str:
        return "incomplete" if self._incomplete() else "completed"

    def _message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [_output_text(text)]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _call(self, call: Any, status: str, arguments: str | None = None) -> dict[str, Any]:
        return {
            "id": "fc_" + call.id.removeprefix("call_"),
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": status,
        }

    # -- the stream ----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def _text_delta(self, text: str) -> bytes:
        self.choice.sent_chars += len(text)
        return self._event(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open_message(self) -> list[bytes]:
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=self._message(None, "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=_output_text(""),
            ),
        ]

    async def events(
        self, producer: asyncio.Task[None], updated: asyncio.Event
    ) -> AsyncIterator[bytes]:
        """Response events as the turn runs: text deltas as they become final (as in a
        chat stream: nothing from a tool-call marker on), the function calls whole
        once the answer is parsed and recorded, then ``response.completed``."""
        yield self._event("response.created", response=self.response("started"))
        yield self._event("response.in_progress", response=self.response("started"))
        choice = self.choice
        opened = False
        async for _ in turn_updates(producer, updated):
            # the chat view's final content so far: without reasoning, held from
            # anything that may still become a tool call
            text = self.view.streamable(choice)[1][choice.sent_chars :]
            if text:
                if not opened:
                    for event in self._open_message():
                        yield event
                    opened = True
                yield self._text_delta(text)
        try:
            producer.result()
        except ApiError as exc:  # the response has started: the error is an event
            yield self._event("error", code=exc.code, message=exc.message, param=exc.param)
            return
        parsed = self.view.parsed(choice)
        index = 0
        if parsed.content is not None:
            if not opened:
                for event in self._open_message():
                    yield event
            rest = parsed.content[choice.sent_chars :]
            if rest:
                yield self._text_delta(rest)
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            yield self._event("response.output_text.done", **where, text=parsed.content,
                              logprobs=[])  # fmt: skip
            yield self._event("response.content_part.done", **where,
                              part=_output_text(parsed.content))  # fmt: skip
            yield self._event(
                "response.output_item.done",
                output_index=0,
                item=self._message(parsed.content, self._item_status()),
            )
            index = 1
        for call in parsed.tool_calls:
            item = self._call(call, "completed")
            where = {"item_id": item["id"], "output_index": index}
            yield self._event(
                "response.output_item.added",
                output_index=index,
                item=self._call(call, "in_progress", arguments=""),
            )
            yield self._event("response.function_call_arguments.delta", **where,
                              delta=call.arguments)  # fmt: skip
            yield self._event("response.function_call_arguments.done", **where,
                              arguments=call.arguments)  # fmt: skip
            yield self._event("response.output_item.done", output_index=index, item=item)
            index += 1
        final = self.response("final")
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=final)


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
