"""The OpenAI-compatible request bodies we accept and the error format we answer with.

Requests are validated with pydantic; anything invalid becomes a 400 with OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}`` before any state changes.
Unknown extra fields are accepted and ignored, as OpenAI clients send many.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse


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

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
        )


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise ApiError(400, "n > 1 is not supported yet; send n requests", param="n")
        if self.stream:
            raise ApiError(400, "stream=true is not supported yet", param="stream")
        if self.stop:
            raise ApiError(400, "stop sequences are not supported yet", param="stop")


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False

    def token_budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def token_budget(self, default: int) -> int:
        # OpenAI's legacy completions default to 16 tokens
        return self.max_tokens or min(default, 16)


class SessionCreate(BaseModel):
    """Body of ``POST /sessions``; every field is optional for ad-hoc external agents."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = "adhoc"
    group_id: str | None = None
    sample_index: int = Field(default=0, ge=0)
    group_size: int = Field(default=1, ge=1)
    reference: str = ""
    reward_fn: str = ""
    policy: str = "default"


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)


def parse(model: type[Any], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
