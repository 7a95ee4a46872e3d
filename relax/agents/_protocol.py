"""The OpenAI API's request bodies and error shape, as the endpoint validates them.

Requests are validated by these pydantic models; every failure becomes an ``ApiError``,
answered as OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with
``param`` naming the offending field (``messages[0].content``).

Nothing is silently ignored: a top-level field this endpoint does not know is refused, as
OpenAI refuses it ("Unrecognized request argument supplied"), and a known field the endpoint
cannot honour (``response_format`` other than text, ``parallel_tool_calls = false``, audio
output, ...) is refused naming the field. Fields with no effect on what is sampled (``user``,
``store``, ``metadata``, ``service_tier``, ``prediction``, ...) are accepted.

A generation request's sampling fields become the engines' ``SamplingParams`` in one place,
``SamplingFields.sampling_params`` (OpenAI's defaults filled in).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from relax.engines import EngineError, SamplingParams

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

    def body(self) -> dict[str, Any]:
        """OpenAI's error object (the value of the body's ``error``)."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> web.Response:
        return web.json_response({"error": self.body()}, status=self.status)


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

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """An extension (vLLM's): keep the k most likely tokens; 0 or -1 disables it."""
    n: int | None = Field(None, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    logit_bias: dict[int, float] | None = None
    """Token id (a JSON object key, so a string of digits) → bias in [-100, 100]."""
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # Accepted, and without effect on what is sampled:
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return _stops(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases")
        out = {}
        for key, bias in value.items():
            if isinstance(key, str) and not key.strip().isdigit():
                raise ValueError(f"key {key!r} is not a token id")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"the bias of token {key} is not a number: {bias!r}")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias}")
            out[int(key)] = float(bias)
        return out

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        """Known fields the endpoint cannot honour: refused by name, never ignored."""
        if not isinstance(data, dict):
            return data
        for name, allowed, why in cls._unsupported():
            if name in data and data[name] is not None and not allowed(data[name]):
                raise _Unsupported(name, why)
        return data

    @classmethod
    def _unsupported(cls) -> list[tuple[str, Any, str]]:
        return []

    def sampling_params(
        self,
        *,
        max_tokens: int,
        top_logprobs: int,
        stop_token_ids: Sequence[int],
        param: str | None = None,
    ) -> SamplingParams:
        """What this request samples: its fields with OpenAI's defaults (temperature and
        top_p 1, no penalties; ``top_k`` 0 or -1 disable it) and what the server decides —
        the token budget ``max_tokens``, the ``top_logprobs`` its route asks for, the
        model's ``stop_token_ids``. Settings the engines refuse are a 400 blaming ``param``."""
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0),
                stop_token_ids=tuple(stop_token_ids),
                n=self.n or 1,
                seed=self.seed,
                logit_bias=self.logit_bias or (),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                top_logprobs=top_logprobs,
            )
        except EngineError as exc:
            raise ApiError(400, str(exc), param=param) from None


class ChatRequest(SamplingFields):
    messages: list[_Message] = Field(min_length=1)
    tools: list[_Tool] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Accepted (refused below when set to what the endpoint cannot do):
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[str] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @classmethod
    def _unsupported(cls) -> list[tuple[str, Any, str]]:
        return [
            (
                "response_format",
                lambda v: isinstance(v, dict) and v.get("type") == "text",
                "only {'type': 'text'} is supported: this endpoint does not constrain decoding"
                " to JSON (ask for JSON in the prompt and parse it)",
            ),
            (
                "parallel_tool_calls",
                lambda v: v is True,
                "false is not supported: the model may write several tool calls in one reply,"
                " and all of them are returned",
            ),
            ("modalities", lambda v: v == ["text"], "only ['text'] output is supported"),
            ("audio", lambda v: False, "audio output is not supported"),
            ("functions", lambda v: False, "the legacy functions API is not supported; use tools"),
            (
                "function_call",
                lambda v: False,
                "the legacy functions API is not supported; use tool_choice",
            ),
            ("web_search_options", lambda v: False, "web search is not supported"),
            ("reasoning_effort", lambda v: False, "this model has no reasoning-effort setting"),
            ("verbosity", lambda v: False, "this model has no verbosity setting"),
        ]

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise _Unsupported("top_logprobs", "it needs logprobs: true")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @classmethod
    def _unsupported(cls) -> list[tuple[str, Any, str]]:
        return [
            ("echo", lambda v: v is False, "echo is not supported"),
            ("suffix", lambda v: v == "", "suffix (insertion) is not supported"),
            ("best_of", lambda v: v == 1, "best_of is not supported; use n and pick yourself"),
        ]

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
    """``POST /relax/v1/sessions/{id}/finish``: the reward (a finite number: a NaN or an
    infinity would poison the whole training step it lands in) and which reply was final;
    ``group``/``group_size``/``uid`` say which training group the row joins. Other fields
    travel on to ``on_finish``."""

    model_config = ConfigDict(extra="allow")
    reward: float = Field(strict=True, allow_inf_nan=False)
    choice: int = Field(0, ge=0, strict=True)
    group: str | int | None = None
    group_size: int | None = Field(None, ge=1, strict=True)
    uid: str | int | None = None

    @field_validator("reward", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        # JSON numbers only: a bool is not a reward, and neither is a numeric string.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a finite number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value!r}")
        return float(value)


def _param(loc: Sequence[int | str]) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


class _Unsupported(ValueError):
    """A known field set to what the endpoint cannot do (raised inside validation)."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"unsupported value of '{param}': {why}")
        self.param = param


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _Unsupported):
        return ApiError(400, str(cause), param=cause.param, code="unsupported_parameter")
    param = _param(first["loc"])
    if first["type"] == "extra_forbidden":
        return ApiError(
            400,
            f"Unrecognized request argument supplied: {param} (this endpoint does not"
            " implement it, and ignoring it would change what you asked for)",
            param=param,
            code="unrecognized_parameter",
        )
    if first["type"] == "missing":
        message = f"missing required parameter '{param}'"
    else:
        message = first["msg"].removeprefix("Value error, ")
        message = f"invalid '{param}': {message}" if param else message
    return ApiError(400, message, param=param)
