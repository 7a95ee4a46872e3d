"""An OpenAI-compatible HTTP endpoint over the policy, recording agent sessions for training.

Any agent framework that speaks the OpenAI API can be the rollout: point an unmodified
``openai`` client at ``{url}/sessions/{session_id}/v1`` and every call of that session is
recorded, token-exact, into one trajectory (see ``relax.agents._sessions``); ``POST
/relax/v1/sessions/{session_id}/finish`` with the reward ends it and hands the trajectory to
``on_finish``. A call without a session (plain ``{url}/v1``, no ``X-Relax-Session`` header) is
plain inference and is not recorded.

Routes (each ``/v1/...`` route also answers under ``/sessions/{session_id}``):

- ``GET /v1/models``, ``GET /v1/models/{model}``
- ``POST /v1/chat/completions``: messages (text content), tools (function tools, Hermes-style
  ``<tool_call>`` parsing), ``n``, ``stop``, ``seed``, ``logprobs``, streaming.
- ``POST /v1/completions``: one prompt (text or token ids), ``n``, ``stop``, ``logprobs``,
  streaming.
- ``GET /relax/v1/version``: the weights version served now.
- ``POST /relax/v1/sessions/{session_id}/finish``: ``{"reward": float, "choice": int, ...}``.

Beyond OpenAI's shapes, a response carries ``relax: {"version", "session"}``, the
``prompt_token_ids`` it was sampled from and, per choice, the kept ``token_ids`` and their
``token_versions`` (the ``openai`` client keeps them in ``model_extra``).

Streaming is OpenAI's Server-Sent Events format, but the generation completes *before* the
first event is sent: engines return whole responses, so a stream is the finished reply cut
into one chunk per token (clients that need streaming work; time-to-first-token is the whole
generation time).

Every error, including an unknown route, is an OpenAI error body ``{"error": {"message",
"type", "param", "code"}}`` with its status: 400 for a malformed or unsupported request (and
for a prompt the engine refuses), 401 without the right ``Authorization: Bearer`` key, 404 for
an unknown model, route or session, 500 when the engine fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import quote

from aiohttp import web
from pydantic import BaseModel, ValidationError

from relax.agents._chat import ChatFormatError, cut_at_stop, parse_tool_calls
from relax.agents._protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    FinishRequest,
    SamplingFields,
    validation_error,
)
from relax.agents._sampler import Sampler
from relax.agents._sessions import Choice, SessionStore
from relax.agents._trajectory import Trajectory
from relax.engines import EngineError, Generation

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Relax-Session"
"""A request header that selects the session (the ``/sessions/{id}`` path prefix wins)."""


OnFinish = Callable[[str, Trajectory, dict[str, Any]], Awaitable[Any]]


# --------------------------------------------------------------------------- the server


class AgentServer:
    """The OpenAI-compatible endpoint (see the module docstring); runs in the caller's loop.

    ``stop_token_ids`` end every generation (the chat end-of-turn, EOS); ``stop`` strings of a
    request cut the reply after the token that completes one. ``max_model_len``: prompt plus
    ``max_tokens`` must fit, else 400 (``None`` leaves the check to the engine).
    ``on_finish(session_id, trajectory, body)`` receives each finished session.
    """

    def __init__(
        self,
        *,
        sampler: Sampler,
        tokenizer: Any,
        sessions: SessionStore,
        stop_token_ids: Sequence[int],
        api_key: str | None = None,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: int | None = None,
        default_max_tokens: int = 64,
        max_n: int = 16,
        on_finish: OnFinish | None = None,
    ) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.sessions = sessions
        self.api_key = api_key
        self.model_name = model_name
        self.host, self.port = host, port
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.max_n = max_n
        self.on_finish = on_finish
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self._created = int(time.time())
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._requests: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._stats = {
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "streams": 0,
            "cancelled": 0,
            "finished": 0,
        }
        self._routes: dict[Any, str] = {}

    # ------------------------------------------------------------------ lifecycle

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        routes: list[tuple[str, str, Any, str]] = [
            ("GET", "/v1/models", self._models, "models"),
            ("GET", "/v1/models/{model:.+}", self._model, "models"),
            ("POST", "/v1/chat/completions", self._chat, "chat"),
            ("POST", "/v1/completions", self._completions, "completions"),
        ]
        for method, path, handler, name in routes:
            app.router.add_route(method, path, handler)
            app.router.add_route(method, "/sessions/{session_id}" + path, handler)
            self._routes[handler] = name
        app.router.add_get("/relax/v1/version", self._version)
        app.router.add_post("/relax/v1/sessions/{session_id}/finish", self._finish)
        self._routes[self._version] = "version"
        self._routes[self._finish] = "finish"
        return app

    async def start(self) -> str:
        """Listen; returns the base url (``http://host:port``)."""
        if self._runner is not None:
            return self.url
        runner = web.AppRunner(
            self._app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        host = f"[{host}]" if ":" in host else host
        self._url = f"http://{host}:{port}"
        return self._url

    async def aclose(self) -> None:
        """Stop listening (requests in flight are given a few seconds to finish)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> AgentServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def url(self) -> str:
        """The base url, e.g. ``http://127.0.0.1:8123`` (after ``start``)."""
        if self._url is None:
            raise RuntimeError("the agent server has not been started")
        return self._url

    def session_url(self, session_id: str) -> str:
        """The ``base_url`` an OpenAI client uses to record into ``session_id``."""
        return f"{self.url}/sessions/{quote(session_id, safe='')}/v1"

    def statistics(self) -> dict[str, Any]:
        """Requests per route, errors per type, tokens in and out, the sampler's and the
        sessions' counters."""
        return {
            "requests": dict(self._requests),
            "errors": dict(self._errors),
            **self._stats,
            "sampler": self.sampler.statistics(),
            "sessions": self.sessions.statistics(),
        }

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self._requests[self._routes.get(handler, "other")] += 1
        try:
            self._authorize(request)
            return await handler(request)
        except ApiError as exc:
            error = exc
        except web.HTTPException as exc:  # no such route, wrong method, body too large
            error = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}")
        except asyncio.CancelledError:
            self._stats["cancelled"] += 1
            raise
        except Exception as exc:
            log.exception("agent endpoint: %s %s failed", request.method, request.path)
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
        self._errors[error.type] += 1
        return error.response()

    def _authorize(self, request: web.Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("Authorization")
        if not header:
            raise ApiError(
                401,
                "no API key: send it as 'Authorization: Bearer <key>'",
                code="missing_api_key",
            )
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), self.api_key.encode()
        ):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    async def _body(self, request: web.Request, model: type[BaseModel]) -> Any:
        raw = await request.read()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model '{model}' does not exist; this endpoint serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def _check_sampling(self, body: SamplingFields) -> None:
        self._check_model(body.model)
        if body.n is not None and body.n > self.max_n:
            raise ApiError(400, f"invalid 'n': at most {self.max_n} choices per request", param="n")

    @staticmethod
    def _session_of(request: web.Request) -> str | None:
        sid = request.match_info.get("session_id") or request.headers.get(SESSION_HEADER, "")
        return sid.strip() or None

    @contextlib.asynccontextmanager
    async def _hold(self, session_id: str | None) -> AsyncIterator[None]:
        """One call at a time per session: the next call continues what the last recorded."""
        if session_id is None:
            yield
            return
        lock, users = self._locks.setdefault(session_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[session_id]

    def _budget(self, prompt_len: int, requested: int | None, param: str) -> int:
        """``max_tokens`` for a prompt of ``prompt_len`` tokens (400 when it cannot fit)."""
        if self.max_model_len is None:
            return requested or self.default_max_tokens
        room = self.max_model_len - prompt_len
        if requested is None:
            if room >= 1:
                return min(self.default_max_tokens, room)
            requested = self.default_max_tokens
        if requested > room:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but"
                f" {prompt_len + requested} were requested ({prompt_len} in the prompt,"
                f" {requested} for the completion); shorten the prompt or max_tokens",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    async def _generate(
        self, ids: list[int], body: SamplingFields, max_tokens: int, param: str
    ) -> list[Generation]:
        try:
            return await self.sampler.generate(
                ids,
                max_new_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                stop_token_ids=self.stop_token_ids,
                n=body.n or 1,
                seed=body.seed,
            )
        except EngineError as exc:
            raise ApiError(400, str(exc), param=param) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("agent endpoint: generation failed")
            raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None

    def _cut(self, gen: Generation, stops: list[str]) -> tuple[list[int], list[float], str, str]:
        """A generation cut at the first stop string: kept ids, logprobs, text, finish reason."""
        ids = gen.response_ids
        if stops:
            kept, text, stopped = cut_at_stop(self.tokenizer, ids, stops)
        else:
            kept, text, stopped = len(ids), self._decode(ids), False
        return ids[:kept], gen.logprobs[:kept], text, "stop" if stopped else gen.finish_reason

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    def _pieces(self, ids: list[int], text: str) -> list[tuple[str, int, int]]:
        """``text`` cut at token boundaries: ``(piece, first token, end token)`` per chunk.

        A token that does not end on a character boundary of ``text`` (half of a multi-byte
        character, a special token) joins the next piece."""
        out: list[tuple[str, int, int]] = []
        done, start = 0, 0
        for k in range(1, len(ids) + 1):
            prefix = self._decode(ids[:k])
            if len(prefix) > done and text.startswith(prefix):
                out.append((text[done : len(prefix)], start, k))
                done, start = len(prefix), k
        if done < len(text) or start < len(ids):
            out.append((text[done:], start, len(ids)))
        return out

    def _extensions(
        self, session_id: str | None, gens: list[Generation], prompt: list[int]
    ) -> dict[str, Any]:
        version = min((g.version for g in gens), default=self.sampler.version)
        return {"relax": {"version": version, "session": session_id}, "prompt_token_ids": prompt}

    @staticmethod
    def _versions(gen: Generation, kept: int) -> dict[str, Any]:
        if gen.token_versions is None:
            return {}
        return {"token_versions": list(gen.token_versions[:kept])}

    def _usage(self, prompt: list[int], choices: list[Choice]) -> dict[str, int]:
        completion = sum(len(c.ids) for c in choices)
        self._stats["prompt_tokens"] += len(prompt)
        self._stats["completion_tokens"] += completion
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
        }

    # ------------------------------------------------------------------ routes

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "relax",
        }
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return card

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.sampler.version})

    async def _finish(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        body: FinishRequest = await self._body(request, FinishRequest)
        async with self._hold(session_id):
            trajectory = self.sessions.finish(session_id, body.reward, choice=body.choice)
        if trajectory is None:
            raise ApiError(
                404,
                f"no session '{session_id}' with a recorded call (unknown, evicted or finished)",
                param="session_id",
                code="session_not_found",
            )
        self._stats["finished"] += 1
        if self.on_finish is not None:
            try:
                await self.on_finish(session_id, trajectory, body.model_dump())
            except Exception as exc:
                log.exception("agent endpoint: on_finish failed for session %s", session_id)
                raise ApiError(500, f"the finished session could not be handed on: {exc}") from None
        return web.json_response(
            {
                "session": session_id,
                "tokens": len(trajectory),
                "turns": trajectory.turns,
                "version": trajectory.version,
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatRequest = await self._body(request, ChatRequest)
        self._check_sampling(body)
        if body.top_logprobs:
            raise ApiError(
                400,
                "top_logprobs is not supported: only the sampled token's logprob is returned"
                " (use logprobs: true with top_logprobs 0 or unset)",
                param="top_logprobs",
            )
        if body.tool_choice not in (None, "auto", "none"):
            raise ApiError(
                400,
                f"tool_choice {body.tool_choice!r} is not supported; use 'auto' or 'none'",
                param="tool_choice",
            )
        session_id = self._session_of(request)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        use_tools = bool(tools) and body.tool_choice != "none"
        async with self._hold(session_id):
            try:
                prompt = self.sessions.chat_prompt(session_id, messages, tools)
            except ChatFormatError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            max_tokens = self._budget(
                len(prompt), body.max_completion_tokens or body.max_tokens, "messages"
            )
            gens = await self._generate(prompt, body, max_tokens, "messages")
            choices, extras = [], []
            for gen in gens:
                ids, logprobs, text, finish = self._cut(gen, body.stop)
                content, calls = parse_tool_calls(text) if use_tools else (text, [])
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["content"] = content or None
                    message["tool_calls"] = [c.openai() for c in calls]
                    finish = "tool_calls"
                choices.append(Choice(gen, ids, logprobs, message=message))
                extras.append(finish)
            self.sessions.record(session_id, choices)
        usage = self._usage(prompt, choices)
        head = self._head("chatcmpl")
        ext = self._extensions(session_id, gens, prompt)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream_chat(
                request, head, ext, choices, extras, usage, bool(body.logprobs), include_usage
            )
        out = []
        for i, (choice, finish) in enumerate(zip(choices, extras, strict=True)):
            out.append(
                {
                    "index": i,
                    "message": choice.message,
                    "finish_reason": finish,
                    "logprobs": {"content": self._chat_logprobs(choice.ids, choice.logprobs)}
                    if body.logprobs
                    else None,
                    "token_ids": choice.ids,
                    **self._versions(choice.generation, len(choice.ids)),
                }
            )
        return web.json_response(
            {**head, "object": "chat.completion", "choices": out, "usage": usage, **ext}
        )

    def _head(self, prefix: str) -> dict[str, Any]:
        """The fields every response object (and stream chunk) of one call starts with."""
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.model_name,
        }

    def _chat_logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        return [
            {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            for s, lp in zip(self._token_strings(ids), logprobs, strict=True)
        ]

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await self._body(request, CompletionRequest)
        self._check_sampling(body)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        session_id = self._session_of(request)
        async with self._hold(session_id):
            prompt = self.sessions.completion_prompt(session_id, body.prompt)
            max_tokens = self._budget(len(prompt), body.max_tokens, "prompt")
            gens = await self._generate(prompt, body, max_tokens, "prompt")
            choices, extras = [], []
            for gen in gens:
                ids, logprobs, text, finish = self._cut(gen, body.stop)
                choices.append(Choice(gen, ids, logprobs, text=text))
                extras.append(finish)
            self.sessions.record(session_id, choices)
        usage = self._usage(prompt, choices)
        head = self._head("cmpl")
        ext = self._extensions(session_id, gens, prompt)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream_completions(
                request, head, ext, choices, extras, usage, body.logprobs, include_usage
            )
        out = []
        for i, (choice, finish) in enumerate(zip(choices, extras, strict=True)):
            out.append(
                {
                    "index": i,
                    "text": choice.text,
                    "finish_reason": finish,
                    "logprobs": None
                    if body.logprobs is None
                    else self._completion_logprobs(choice.ids, choice.logprobs, body.logprobs),
                    "token_ids": choice.ids,
                    **self._versions(choice.generation, len(choice.ids)),
                }
            )
        return web.json_response(
            {**head, "object": "text_completion", "choices": out, "usage": usage, **ext}
        )

    def _completion_logprobs(
        self, ids: list[int], logprobs: list[float], top: int, offset: int = 0
    ) -> dict[str, Any]:
        tokens = self._token_strings(ids)
        offsets = [offset + len(self._decode(ids[:k])) for k in range(len(ids))]
        return {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": [{s: lp} for s, lp in zip(tokens, logprobs, strict=True)]
            if top > 0
            else None,
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ streaming

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        self._stats["streams"] += 1
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, data: dict[str, Any] | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await response.write(f"data: {text}\n\n".encode())

    async def _stream_chat(
        self,
        request: web.Request,
        head: dict[str, Any],
        ext: dict[str, Any],
        choices: list[Choice],
        finishes: list[str],
        usage: dict[str, int],
        logprobs: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = await self._open_stream(request)
        base = {**head, "object": "chat.completion.chunk", **ext}
        if include_usage:
            base["usage"] = None

        def chunk(i: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
            choice = {"index": i, "delta": delta, "finish_reason": None, "logprobs": None}
            return {**base, "choices": [{**choice, **extra}]}

        with contextlib.suppress(ConnectionError):
            for i, (choice, finish) in enumerate(zip(choices, finishes, strict=True)):
                message = choice.message or {}
                await self._send(response, chunk(i, {"role": "assistant", "content": ""}))
                calls = message.get("tool_calls")
                if calls:
                    pieces = [(message.get("content") or "", 0, len(choice.ids))]
                else:
                    pieces = self._pieces(choice.ids, message.get("content") or "")
                for piece, start, end in pieces:
                    lps = None
                    if logprobs:
                        lps = {
                            "content": self._chat_logprobs(
                                choice.ids[start:end], choice.logprobs[start:end]
                            )
                        }
                    if piece or lps:
                        await self._send(response, chunk(i, {"content": piece}, logprobs=lps))
                if calls:
                    deltas = [{"index": j, **call} for j, call in enumerate(calls)]
                    await self._send(response, chunk(i, {"tool_calls": deltas}))
                await self._send(
                    response,
                    chunk(
                        i,
                        {},
                        finish_reason=finish,
                        token_ids=choice.ids,
                        **self._versions(choice.generation, len(choice.ids)),
                    ),
                )
            if include_usage:
                await self._send(response, {**base, "choices": [], "usage": usage})
            await self._send(response, "[DONE]")
            await response.write_eof()
        return response

    async def _stream_completions(
        self,
        request: web.Request,
        head: dict[str, Any],
        ext: dict[str, Any],
        choices: list[Choice],
        finishes: list[str],
        usage: dict[str, int],
        logprobs: int | None,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = await self._open_stream(request)
        base = {**head, "object": "text_completion", **ext}
        if include_usage:
            base["usage"] = None

        def chunk(i: int, text: str, **extra: Any) -> dict[str, Any]:
            choice = {"index": i, "text": text, "finish_reason": None, "logprobs": None}
            return {**base, "choices": [{**choice, **extra}]}

        with contextlib.suppress(ConnectionError):
            for i, (choice, finish) in enumerate(zip(choices, finishes, strict=True)):
                text = choice.text or ""
                offset = 0
                for piece, start, end in self._pieces(choice.ids, text):
                    lps = None
                    if logprobs is not None:
                        lps = self._completion_logprobs(
                            choice.ids[start:end], choice.logprobs[start:end], logprobs, offset
                        )
                    offset += len(piece)
                    await self._send(response, chunk(i, piece, logprobs=lps))
                await self._send(
                    response,
                    chunk(
                        i,
                        "",
                        finish_reason=finish,
                        token_ids=choice.ids,
                        **self._versions(choice.generation, len(choice.ids)),
                    ),
                )
            if include_usage:
                await self._send(response, {**base, "choices": [], "usage": usage})
            await self._send(response, "[DONE]")
            await response.write_eof()
        return response
