"""The OpenAI-compatible request bodies we accept and the error format we answer with.

Over 400 lines: the table of every request parameter of both APIs is one list on purpose.

Requests are validated with pydantic; anything invalid becomes a 400 with OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}`` before any state changes.

No request parameter is silently dropped: ``CHAT_PARAMS`` and ``COMPLETION_PARAMS`` list
every top-level field of the two APIs (the ``openai`` package's request types, plus the
vLLM extras we know) with what the gateway does with it (`Param`). A field outside the
table, or a refused one with a value other than null or its neutral value, is a 400
naming it. In RL this matters more than for a chat server: a parameter that changes the
sampling distribution but is neither applied nor recorded makes the trained logprobs
disagree with what the agent asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.responses import JSONResponse

from seamlessflow.protocol import FAILURE_PATTERN, GREEDY_BELOW, SEEDS, TOP_P_MIN


class ApiError(Exception):
    """An error answered to the agent with an HTTP status and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        # OpenAI clients retry 409 and every 5xx unless told otherwise: a refused
        # request (a finished session included) fails the same way when repeated.
        retry = "true" if self.status in (408, 429) or self.status >= 500 else "false"
        return JSONResponse(self.body(), status_code=self.status, headers={"x-should-retry": retry})


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


MAX_CHOICES = 16
"""Largest ``n``: every choice is its own engine request and recorded turn."""
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_STEP_REWARDS = 4096
"""Step rewards one report may carry (an episode of more steps reports its return only)."""


# --------------------------------------------------------------- the parameter table

Neutral = Callable[[Any, Mapping[str, Any]], bool]
"""Whether a refused parameter's value (with the whole body) is its neutral value: the
value that asks for what the gateway does anyway, accepted."""


def _never(value: Any, body: Mapping[str, Any]) -> bool:
    return False


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _equals(neutral: float) -> Neutral:
    return lambda value, body: _number(value) and value == neutral


def _is(*neutral: Any) -> Neutral:
    return lambda value, body: any(
        value is n if isinstance(n, bool) else value == n and not isinstance(value, bool)
        for n in neutral
    )


def _no_bias(value: Any, body: Mapping[str, Any]) -> bool:
    return isinstance(value, dict) and all(_number(v) and v == 0 for v in value.values())


def _text_only(value: Any, body: Mapping[str, Any]) -> bool:
    return value == ["text"]


def _best_of_n(value: Any, body: Mapping[str, Any]) -> bool:
    return _number(value) and value == (body.get("n") or 1)


def _empty(value: Any, body: Mapping[str, Any]) -> bool:
    return value in ("", {}, [])


@dataclass(frozen=True)
class Param:
    """What the gateway does with one request parameter.

    - ``honoured``: validated, applied (by both engines when it affects sampling) and,
      when it changes the sampling distribution, recorded with the turn;
    - ``no_effect``: accepted and ignored, because it genuinely does not change what is
      generated nor what the agent gets (``why`` says why);
    - ``refused``: a value other than null or ``neutral`` is a 400 naming it (``why``
      is the reason, in the error message).
    """

    effect: Literal["honoured", "no_effect", "refused"]
    why: str
    neutral: Neutral = _never


def _honoured(why: str) -> Param:
    return Param("honoured", why)


def _no_effect(why: str) -> Param:
    return Param("no_effect", why)


def _refused(why: str, neutral: Neutral = _never) -> Param:
    return Param("refused", why, neutral)


_SAME_DISTRIBUTION = (
    "the trainer recomputes each token's logprob as log_softmax(logits / temperature) "
    "from the weights alone, so only parameters it can recompute may change sampling"
)
_PENALTY = (
    f"not applied by the engines: a penalty depends on the tokens generated so far; "
    f"{_SAME_DISTRIBUTION}"
)

_COMMON: dict[str, Param] = {
    "model": _honoured("picks the policy whose engines answer; recorded as the turn's policy"),
    "max_tokens": _honoured(
        "the token budget; prompt + max_tokens beyond the context is a 400 (as in vLLM)"
    ),
    "temperature": _honoured("applied by the engines; recorded with the turn"),
    "top_p": _honoured("applied by the engines; recorded with the turn"),
    "n": _honoured("n engine requests, each recorded as a sibling turn"),
    "seed": _honoured("choice i is seeded with seed + i"),
    "stop": _honoured("matched in the decoded text; the engine request is aborted there"),
    "stream": _honoured("server-sent events"),
    "stream_options": _honoured("include_usage adds the usage chunk"),
    "frequency_penalty": _refused(_PENALTY, _equals(0)),
    "presence_penalty": _refused(_PENALTY, _equals(0)),
    "logit_bias": _refused(f"not applied by the engines; {_SAME_DISTRIBUTION}", _no_bias),
    "user": _no_effect("an end-user id for abuse tracking; generation does not read it"),
}

VLLM_EXTRAS: dict[str, Param] = {
    "top_k": _honoured(
        "applied by both engines (then top_p within the k, as vLLM does); recorded with "
        "the turn; like top_p it does not change the logprobs, taken before truncation"
    ),
    "min_p": _refused(f"not applied by the engines; {_SAME_DISTRIBUTION}", _equals(0)),
    "repetition_penalty": _refused(_PENALTY, _equals(1)),
    "min_tokens": _refused(
        f"would mask the stop tokens, not applied by the engines; {_SAME_DISTRIBUTION}",
        _equals(0),
    ),
    "ignore_eos": _refused("the engines always stop at the stop tokens", _is(False)),
    "skip_special_tokens": _refused(
        "the text an agent gets always skips special tokens", _is(True)
    ),
    "include_stop_str_in_output": _refused(
        "the text an agent gets ends before a stop string", _is(False)
    ),
    "return_token_ids": _honoured(
        "the ids the engine was given (prompt_token_ids, a forced tool-call opening "
        "included) and each choice's generated ids (token_ids), exactly as the turn is "
        "recorded for training; streamed, the prompt's come in the first chunk and each "
        "chunk carries its new ids"
    ),
    "guided_json": _refused("no constrained decoding: use tools or prompt for JSON"),
    "guided_regex": _refused("no constrained decoding"),
    "guided_choice": _refused("no constrained decoding"),
    "guided_grammar": _refused("no constrained decoding"),
    "structured_outputs": _refused("no constrained decoding"),
}
"""Fields vLLM's OpenAI server takes beyond OpenAI's; any other unknown field is a 400."""

VLLM_CHAT_EXTRAS: dict[str, Param] = {
    "chat_template_kwargs": _refused(
        "not passed to the chat template (the session's stored history is rendered without them)",
        _empty,
    ),
}
"""vLLM's chat-only extras."""

CHAT_PARAMS: dict[str, Param] = {
    **_COMMON,
    **VLLM_EXTRAS,
    **VLLM_CHAT_EXTRAS,
    "messages": _honoured("templated by the model's chat template; history keeps its ids"),
    "max_completion_tokens": _honoured("as max_tokens (it wins when both are given)"),
    "logprobs": _honoured("the engines' logprobs, the same values the turn records"),
    "top_logprobs": _honoured("from the engines, under the sampled token's distribution"),
    "tools": _honoured("passed to the chat template; replies parsed for tool calls"),
    "tool_choice": _honoured(
        "'auto', 'none', and 'required' or a named function by a forced opening of the "
        "call appended to the prompt (inserted, not sampled: recorded as prompt ids)"
    ),
    "parallel_tool_calls": _refused(
        "every tool call the model writes is returned; limiting them to one would need "
        "constrained decoding",
        _is(True),
    ),
    "response_format": _honoured(
        "json_object / json_schema by the vLLM engine's structured outputs (the "
        "transformers engine answers 400); such turns are recorded as constrained and "
        "not trained: a constrained token's logprob is not the weights' distribution"
    ),
    "functions": _refused("deprecated by OpenAI: use tools"),
    "function_call": _refused("deprecated by OpenAI: use tool_choice"),
    "audio": _refused("text models: no audio output"),
    "modalities": _refused("text models: only ['text']", _text_only),
    "moderation": _refused("no moderation is run"),
    "web_search_options": _refused("no web search tool"),
    "reasoning_effort": _refused(
        "not passed to the chat template (a model that reads it would generate differently)"
    ),
    "verbosity": _refused("not passed to the chat template"),
    "prediction": _no_effect(
        "predicted outputs only speed up decoding; the generated tokens are the same"
    ),
    "metadata": _no_effect("tags for OpenAI's stored completions; generation ignores them"),
    "store": _no_effect(
        "concerns OpenAI's stored-completions dashboard; every turn is recorded for "
        "training regardless (that is the gateway's purpose)"
    ),
    "service_tier": _no_effect("a billing/latency tier; generation is the same"),
    "safety_identifier": _no_effect("an end-user id for abuse tracking"),
    "prompt_cache_key": _no_effect("a prompt-cache routing hint; generation is the same"),
    "prompt_cache_retention": _no_effect("a prompt-cache lifetime hint"),
    "prompt_cache_options": _no_effect("prompt-cache hints; generation is the same"),
}
"""Every top-level field of ``POST /v1/chat/completions``."""

COMPLETION_PARAMS: dict[str, Param] = {
    **_COMMON,
    **VLLM_EXTRAS,
    "prompt": _honoured(
        "text (tokenized) or token ids, used as given; a batch of one prompt (['text'], "
        "[[ids]]) is that prompt, a larger batch is a 400"
    ),
    "logprobs": _honoured("k top logprobs per token, from the engines"),
    "echo": _refused("the prompt is not echoed back in the text", _is(False)),
    "suffix": _refused("no insertion (fill-in-the-middle) template", _empty),
    "best_of": _refused(
        "no server-side choice among samples: every sample is a recorded turn (ask for n)",
        _best_of_n,
    ),
}
"""Every top-level field of ``POST /v1/completions``."""


def check_params(params: Mapping[str, Param], body: Mapping[str, Any]) -> None:
    """400 for the first field of ``body`` that ``params`` does not list, or lists as
    refused with a value other than null or its neutral value."""
    for name, value in body.items():
        param = params.get(name)
        if param is None:
            raise ApiError(
                400,
                f"unknown parameter {name!r}: not an OpenAI request field the gateway knows",
                param=name,
                code="unknown_parameter",
            )
        if param.effect == "refused" and value is not None and not param.neutral(value, body):
            raise ApiError(
                400,
                f"{name} is not supported: {param.why}",
                param=name,
                code="unsupported_parameter",
            )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _Request(BaseModel):
    # every field is screened by ``PARAMS`` first (`parse`): what reaches the model is
    # either a field here or one the table accepts without effect
    model_config = ConfigDict(extra="ignore")
    PARAMS: ClassVar[Mapping[str, Param]] = {}

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    """vLLM's extra; -1 and 0 are off (made 0)."""
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(default=None, ge=SEEDS.start, lt=SEEDS.stop)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    return_token_ids: bool = False
    """vLLM's extra: the prompt's and each choice's token ids in the response."""

    @field_validator("temperature")
    @classmethod
    def _greedy_if_tiny(cls, temperature: float) -> float:
        return 0.0 if temperature < GREEDY_BELOW else temperature

    @field_validator("top_p")
    @classmethod
    def _nucleus_of_one_if_tiny(cls, top_p: float) -> float:
        return max(top_p, TOP_P_MIN)

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, top_k: int) -> int:
        return max(top_k, 0)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(not s for s in strings):
            raise ValueError("stop sequences must be non-empty")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check(self) -> None:
        """Checks across fields (after field validation)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")  # fmt: skip


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    arguments: str


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessageIn:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool messages need the tool_call_id they answer")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (content always a string)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})

    @field_validator("parameters")
    @classmethod
    def _check_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON schema of type object")
        if not isinstance(schema.get("properties", {}), dict):
            raise ValueError("function parameters' properties must be an object")
        return schema


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(_Request):
    PARAMS: ClassVar[Mapping[str, Param]] = CHAT_PARAMS
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _check_format(cls, form: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = form.get("type") if form is not None else "text"
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError("type must be 'text', 'json_object' or 'json_schema'")
        if kind == "json_schema":
            spec = form.get("json_schema") if form is not None else None
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("json_schema needs {'name': ..., 'schema': {...}}")
        return form

    @property
    def structured_output(self) -> str:
        """The engines' constraint for ``response_format`` (empty: none)."""
        form = self.response_format or {"type": "text"}
        if form["type"] == "json_object":
            return json.dumps({"json_object": True})
        if form["type"] == "json_schema":
            return json.dumps({"json": form["json_schema"].get("schema", {})})
        return ""

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.structured_output and self.forces_tool_call:
            raise ApiError(
                400,
                "response_format json_object/json_schema cannot be combined with a forced "
                "tool_choice",
                param="response_format",
            )
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ApiError(
                400,
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if choice is not None and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ApiError(
                    400,
                    'a named tool_choice is {"type": "function", "function": {"name": ...}} '
                    "(other kinds are not supported)",
                    param="tool_choice",
                )
            if name not in {t.function.name for t in self.tools or []}:
                raise ApiError(
                    400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
                )

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice 'required' or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    @property
    def forced_tool_name(self) -> str | None:
        """The function a named tool_choice forces (None: 'required' or not forced)."""
        if isinstance(self.tool_choice, dict):
            return str(self.tool_choice["function"]["name"])
        return None

    def token_budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    @property
    def budget_param(self) -> str | None:
        """The field the agent set its token budget with (None: the default applies)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens is not None else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as given (validated), for the chat template; None without tools."""
        return [t.model_dump(exclude_unset=True) for t in self.tools] if self.tools else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def k_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Request):
    PARAMS: ClassVar[Mapping[str, Param]] = COMPLETION_PARAMS
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """OpenAI's and vLLM's batch forms (a list of strings, a list of id lists) with
        one prompt in them are that prompt; several are refused: one turn per request,
        and ``n`` asks for several samples of one prompt."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(
                    f"one prompt per request, got {len(prompt)} (n samples one prompt n times)"
                )
            return prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    def token_budget(self, default: int) -> int:
        # OpenAI's legacy completions default to 16 tokens
        return self.max_tokens or min(default, 16)

    @property
    def budget_param(self) -> str | None:
        return "max_tokens" if self.max_tokens is not None else None

    @property
    def k_top_logprobs(self) -> int:
        return self.logprobs or 0


class SessionCreate(BaseModel):
    """Body of ``POST /sessions``; every field is optional for ad-hoc external agents."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = "adhoc"
    group_id: str | None = None
    sample_index: int = Field(default=0, ge=0)
    group_size: int = Field(default=1, ge=1)
    reference: str = ""
    reward_fn: str = ""
    policy: str = ""
    """The task's policy (its answers are what ``reward_fn`` scores); empty = the run's
    first policy."""
    min_version: int = Field(default=0, ge=0)
    """Engines answer this session's calls to ``policy`` on weights of at least this
    version (a synchronous run's runner passes its task's ``min_version``); 0: any."""


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)
    policy: str = ""
    """Which policy the reward is for (multi-policy agents report one per policy);
    empty = every policy of the session without one of its own."""
    step_rewards: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(
        default_factory=list, max_length=MAX_STEP_REWARDS
    )
    """The environment's reward at each step of the episode, if it gave them (kept with
    the session; ``reward`` is the one trained on)."""


class FinishBody(BaseModel):
    """Body of ``POST /sessions/<id>/finish`` (optional: no body is a normal finish)."""

    model_config = ConfigDict(extra="forbid")

    failure: str = Field(default="", pattern=FAILURE_PATTERN)
    """Why the episode failed (``env_timeout``, ...): its sample is dropped with this
    reason. Empty: it did not fail."""


def parse(model: type[Any], body: Any) -> Any:
    params = getattr(model, "PARAMS", None)
    if params is not None and isinstance(body, Mapping):
        check_params(params, body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize`` (as vLLM's server): chat ``messages`` (and ``tools``),
    tokenized exactly as a chat turn would be, or a ``prompt`` string, as a completion."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    """Checked against the served models when given (one tokenizer serves them all)."""
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    tools: list[ToolDef] | None = None
    prompt: str | None = None
    return_token_strs: bool = False
    """Also answer each token's string (``token_strs``, as chat logprobs spell tokens)."""

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages and prompt")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    """The context: prompt plus completion tokens may not exceed it."""
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """Body of ``POST /detokenize``: token ids back to text (special tokens kept)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
