"""The OpenAI API's request bodies and error shape, as the endpoint validates them.

Requests are validated by these pydantic models; every failure becomes an ``ApiError``,
answered as OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with
``param`` naming the offending field (``messages[0].content``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class ApiError(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return web.json_response(body, status=self.status)


# --------------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _MessageToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string, a list of text parts or null")
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is of type {kind!r}; only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} has no string 'text'")
        return value


class _FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Body):
    type: Literal["function"]
    function: _FunctionSpec


class _StreamOptions(_Body):
    include_usage: bool | None = None


def _stops(value: Any) -> Any:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and len(value) > 4:
        raise ValueError(f"at most 4 stop sequences are supported, got {len(value)}")
    return value


class SamplingFields(_Body):
    """Fields both generation routes share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return _stops(value)


class ChatRequest(SamplingFields):
    messages: list[_Message] = Field(min_length=1)
    tools: list[_Tool] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not _is_ids(value):
            if len(value) > 1:
                raise ValueError(
                    f"a batch of {len(value)} prompts was sent; send one prompt per request"
                )
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and not _is_ids(value):
            raise ValueError("must be a string or a list of token ids")
        return value


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    reward: float
    choice: int = Field(0, ge=0)


def _param(loc: Sequence[int | str]) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    param = _param(first["loc"])
    if first["type"] == "missing":
        message = f"missing required parameter '{param}'"
    else:
        message = first["msg"].removeprefix("Value error, ")
        message = f"invalid '{param}': {message}" if param else message
    return ApiError(400, message, param=param)
