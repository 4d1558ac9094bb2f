"""The OpenAI-compatible request bodies we accept and the error format we answer with.

Requests are validated with pydantic; anything invalid becomes a 400 with OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}`` before any state changes.
Unknown extra fields are accepted and ignored, as OpenAI clients send many.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.responses import JSONResponse

from seamlessflow.protocol import GREEDY_BELOW, SEEDS, TOP_P_MIN


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(default=None, ge=SEEDS.start, lt=SEEDS.stop)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None

    @field_validator("temperature")
    @classmethod
    def _greedy_if_tiny(cls, temperature: float) -> float:
        return 0.0 if temperature < GREEDY_BELOW else temperature

    @field_validator("top_p")
    @classmethod
    def _nucleus_of_one_if_tiny(cls, top_p: float) -> float:
        return max(top_p, TOP_P_MIN)

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
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | str | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "only tool_choice 'auto' and 'none' are supported",
                           param="tool_choice")  # fmt: skip
        if self.tool_choice is not None and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")

    def token_budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

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
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def token_budget(self, default: int) -> int:
        # OpenAI's legacy completions default to 16 tokens
        return self.max_tokens or min(default, 16)

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


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)
    policy: str = ""
    """Which policy the reward is for (multi-policy agents report one per policy);
    empty = every policy of the session without one of its own."""


def parse(model: type[Any], body: Any) -> Any:
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
