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
  ``<tool_call>`` parsing), ``n``, ``stop``, ``seed``, ``logprobs``/``top_logprobs``, the
  sampling fields below, streaming.
- ``POST /v1/completions``: one prompt (text or token ids), ``n``, ``stop``, ``logprobs=N``,
  the sampling fields below, streaming.
- ``GET /relax/v1/version``: the weights version served now.
- ``POST /relax/v1/sessions/{session_id}/finish``: ``{"reward": float, "choice": int, ...}``.

Beyond OpenAI's shapes, a response carries ``relax: {"version", "session"}``, the
``prompt_token_ids`` it was sampled from and, per choice, the kept ``token_ids`` and their
``token_versions`` (the ``openai`` client keeps them in ``model_extra``).

Streaming is OpenAI's Server-Sent Events format, sent as tokens are sampled (engines that
stream, ``HFEngine``; vLLM's replies are streamed once complete): a piece of text goes out as
soon as nothing later can take it back (see ``relax.agents._streaming``), and the pieces add up
to the unstreamed reply, logprobs included. Concurrent streams still share engine batches.

Sampling follows the request: ``temperature``, ``top_p``, ``top_k`` (an extension), ``seed``,
``logit_bias``, ``presence_penalty``, ``frequency_penalty``; every logprob returned (and the
one training uses) is of the *processed* distribution the token was drawn from — bias and
penalties included — and ``top_logprobs`` (chat) / ``logprobs=N`` (completions) are that
distribution's most likely tokens. Request fields the endpoint cannot honour are refused with a
400 naming them (see ``relax.agents._protocol``), never ignored.

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
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast
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
from relax.agents._streaming import ChoiceStream
from relax.agents._trajectory import Trajectory
from relax.engines import EngineError, Generation, TokenEvent
from relax.errors import BadRow
from relax.log import get_logger

log = get_logger(__name__)

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
            log.exception(
                "agent endpoint: request failed", method=request.method, path=request.path
            )
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
        if body.logit_bias:
            vocab = len(self.tokenizer)
            unknown = [t for t in body.logit_bias if not 0 <= t < vocab]
            if unknown:
                raise ApiError(
                    400,
                    f"invalid 'logit_bias': token ids {unknown[:5]} are outside the vocabulary"
                    f" [0, {vocab})",
                    param="logit_bias",
                )

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
        self, call: _Call, on_event: Callable[[TokenEvent], Awaitable[None]] | None = None
    ) -> list[Generation]:
        """The call's generations; ``on_event`` hears each token as it is sampled (awaited in
        order, so a slow client slows only its own stream)."""
        body = call.body
        queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        task = asyncio.ensure_future(
            self.sampler.generate(
                call.prompt,
                max_new_tokens=call.max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(body.top_k or 0, 0),
                stop_token_ids=self.stop_token_ids,
                n=body.n or 1,
                seed=body.seed,
                logit_bias=body.logit_bias,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                top_logprobs=call.top,
                on_token=queue.put_nowait if on_event is not None else None,
            )
        )
        # Every token is queued before the result is (see ``Sampler``): None ends the events.
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            if on_event is not None:  # its own errors (a client gone) pass through as they are
                while (event := await queue.get()) is not None:
                    await on_event(event)
            try:
                return await task
            except EngineError as exc:
                raise ApiError(400, str(exc), param=call.param) from None
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("agent endpoint: generation failed")
                raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None
        finally:
            if not task.done():  # the client went away: its request leaves the sampler
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

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
            trajectory = self.sessions.finished(session_id, body.reward, choice=body.choice)
            if trajectory is None:
                raise ApiError(
                    404,
                    f"no session '{session_id}' with a recorded call (unknown, evicted or"
                    " finished)",
                    param="session_id",
                    code="session_not_found",
                )
            if self.on_finish is not None:
                # The session stays open until its row is handed on: a refused finish (a bad
                # group, a bus that is down) loses nothing and may be sent again.
                try:
                    await self.on_finish(session_id, trajectory, body.model_dump(exclude_none=True))
                except BadRow as exc:
                    raise ApiError(
                        400,
                        f"the session's row was refused: {exc}; the session is still open",
                        param=exc.field if exc.field in FinishRequest.model_fields else None,
                    ) from None
                except Exception as exc:
                    log.exception("agent endpoint: on_finish failed", session=session_id)
                    raise ApiError(
                        500,
                        f"the finished session could not be handed on: {exc}; the session is"
                        " still open",
                    ) from None
            self.sessions.close(session_id)
        self._stats["finished"] += 1
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
        top = (body.top_logprobs or 0) if body.logprobs else 0
        call = _Call("chat", body, bool(body.logprobs), top, use_tools)
        async with self._hold(session_id):
            try:
                prompt = self.sessions.chat_prompt(session_id, messages, tools)
            except ChatFormatError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            call.prompt = prompt
            call.max_tokens = self._budget(
                len(prompt), body.max_completion_tokens or body.max_tokens, "messages"
            )
            call.param = "messages"
            if body.stream:
                return await self._stream(request, call, session_id)
            gens = await self._generate(call)
            choices, finishes = self._choices(call, gens)
            self.sessions.record(session_id, choices)
        usage = self._usage(prompt, choices)
        out = []
        for i, (choice, finish) in enumerate(zip(choices, finishes, strict=True)):
            out.append(
                {
                    "index": i,
                    "message": choice.message,
                    "finish_reason": finish,
                    "logprobs": {"content": self._chat_logprobs(choice, 0, len(choice.ids))}
                    if body.logprobs
                    else None,
                    "token_ids": choice.ids,
                    **self._versions(choice.generation, len(choice.ids)),
                }
            )
        return web.json_response(
            {
                **self._head("chatcmpl"),
                "object": "chat.completion",
                "choices": out,
                "usage": usage,
                **self._extensions(session_id, gens, prompt),
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await self._body(request, CompletionRequest)
        self._check_sampling(body)
        session_id = self._session_of(request)
        top = body.logprobs or 0
        call = _Call("completions", body, body.logprobs is not None, top, False)
        async with self._hold(session_id):
            prompt = self.sessions.completion_prompt(session_id, body.prompt)
            call.prompt = prompt
            call.max_tokens = self._budget(len(prompt), body.max_tokens, "prompt")
            call.param = "prompt"
            if body.stream:
                return await self._stream(request, call, session_id)
            gens = await self._generate(call)
            choices, finishes = self._choices(call, gens)
            self.sessions.record(session_id, choices)
        usage = self._usage(prompt, choices)
        out = []
        for i, (choice, finish) in enumerate(zip(choices, finishes, strict=True)):
            out.append(
                {
                    "index": i,
                    "text": choice.text,
                    "finish_reason": finish,
                    "logprobs": self._completion_logprobs(choice, 0, len(choice.ids), top)
                    if call.logprobs
                    else None,
                    "token_ids": choice.ids,
                    **self._versions(choice.generation, len(choice.ids)),
                }
            )
        return web.json_response(
            {
                **self._head("cmpl"),
                "object": "text_completion",
                "choices": out,
                "usage": usage,
                **self._extensions(session_id, gens, prompt),
            }
        )

    def _choices(self, call: _Call, gens: list[Generation]) -> tuple[list[Choice], list[str]]:
        """Each generation as the reply it is: cut at stop strings, tool calls parsed."""
        choices, finishes = [], []
        for gen in gens:
            ids, logprobs, text, finish = self._cut(gen, call.body.stop)
            tops = gen.top_logprobs[: len(ids)] if gen.top_logprobs is not None else None
            if call.kind == "chat":
                content, calls = parse_tool_calls(text) if call.tools else (text, [])
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["content"] = content or None
                    message["tool_calls"] = [c.openai() for c in calls]
                    finish = "tool_calls"
                choices.append(Choice(gen, ids, logprobs, message=message, top_logprobs=tops))
            else:
                choices.append(Choice(gen, ids, logprobs, text=text, top_logprobs=tops))
            finishes.append(finish)
        return choices, finishes

    def _head(self, prefix: str) -> dict[str, Any]:
        """The fields every response object (and stream chunk) of one call starts with."""
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.model_name,
        }

    def _logprob_entry(self, token: int, logprob: float) -> dict[str, Any]:
        s = self._token_strings([token])[0]
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    def _chat_logprobs(self, choice: Choice, start: int, end: int) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs.content`` of tokens ``start:end`` of a reply."""
        tops = choice.top_logprobs
        out = []
        for t in range(start, end):
            entry = self._logprob_entry(choice.ids[t], choice.logprobs[t])
            entry["top_logprobs"] = (
                [self._logprob_entry(i, v) for i, v in tops[t]] if tops is not None else []
            )
            out.append(entry)
        return out

    def _completion_logprobs(
        self, choice: Choice, start: int, end: int, top: int, offset: int = 0
    ) -> dict[str, Any]:
        """OpenAI's completions ``logprobs`` of tokens ``start:end``: ``top_logprobs`` holds
        the ``top`` most likely tokens and, as OpenAI's does, the sampled one."""
        ids = choice.ids[start:end]
        tokens = self._token_strings(ids)
        offsets = [offset + len(self._decode(ids[:k])) for k in range(len(ids))]
        tops = None
        if top > 0 and choice.top_logprobs is not None:
            tops = []
            for t, (token, lp) in enumerate(zip(tokens, choice.logprobs[start:end], strict=True)):
                entry: dict[str, float] = {}
                for i, v in choice.top_logprobs[start + t]:
                    entry.setdefault(self._token_strings([i])[0], v)
                entry.setdefault(token, lp)
                tops.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": list(choice.logprobs[start:end]),
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self, request: web.Request, call: _Call, session_id: str | None
    ) -> web.StreamResponse:
        """Serve a streamed call (holding its session): chunks go out as tokens are sampled.

        The response opens with the first token, so a request refused before any token is
        sampled is still an ordinary error answer; a failure after that is an ``error`` event
        (the ``openai`` client raises it) closing the stream.
        """
        n = call.body.n or 1
        chat = call.kind == "chat"
        streams = [ChoiceStream(self._decode, call.body.stop, call.tools) for _ in range(n)]
        base = {
            **self._head("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "relax": {"version": self.sampler.version, "session": session_id},
            "prompt_token_ids": call.prompt,
        }
        include_usage = bool(call.body.stream_options and call.body.stream_options.include_usage)
        if include_usage:
            base["usage"] = None
        response: web.StreamResponse | None = None
        offsets = [0] * n

        def chunk(i: int, **fields: Any) -> dict[str, Any]:
            choice = {"index": i, "finish_reason": None, "logprobs": None, **fields}
            return {**base, "choices": [choice]}

        async def opened() -> web.StreamResponse:
            nonlocal response
            if response is None:
                response = await self._open_stream(request)
                if chat:
                    for i in range(n):
                        delta = {"role": "assistant", "content": ""}
                        await self._send(response, chunk(i, delta=delta))
            return response

        def piece_chunk(
            i: int,
            piece: str,
            start: int,
            end: int,
            ids: list[int],
            lps: list[float],
            tops: list[list[tuple[int, float]]] | None,
        ) -> dict[str, Any]:
            partial = Choice(None, ids, lps, top_logprobs=tops)  # type: ignore[arg-type]
            if chat:
                scored = (
                    {"content": self._chat_logprobs(partial, start, end)} if call.logprobs else None
                )
                return chunk(i, delta={"content": piece}, logprobs=scored)
            scored = (
                self._completion_logprobs(partial, start, end, call.top, offsets[i])
                if call.logprobs
                else None
            )
            offsets[i] += len(piece)
            return chunk(i, text=piece, logprobs=scored)

        async def on_event(event: TokenEvent) -> None:
            out = await opened()
            state = streams[event.sequence]
            sent = state.add(event)
            if sent is not None:
                piece, start, end = sent
                tops = cast(list[list[tuple[int, float]]], state.tops) if call.top else None
                data = piece_chunk(
                    event.sequence, piece, start, end, state.ids, state.logprobs, tops
                )
                await self._send(out, data)

        try:
            gens = await self._generate(call, on_event)
        except ApiError as exc:
            if response is None:
                raise
            with contextlib.suppress(ConnectionError):
                await self._send(response, {"error": exc.body()})
                await response.write_eof()
            self._errors[exc.type] += 1
            return response
        except ConnectionError:  # the client went away mid-stream: nothing is recorded
            self._stats["cancelled"] += 1
            assert response is not None
            return response
        choices, finishes = self._choices(call, gens)
        self.sessions.record(session_id, choices)
        usage = self._usage(call.prompt, choices)
        out = await opened()
        with contextlib.suppress(ConnectionError):
            for i, (choice, finish) in enumerate(zip(choices, finishes, strict=True)):
                message = choice.message or {}
                text = (message.get("content") or "") if chat else (choice.text or "")
                rest, start, end = streams[i].finish(text, len(choice.ids))
                if rest or (call.logprobs and end > start):
                    data = piece_chunk(
                        i, rest, start, end, choice.ids, choice.logprobs, choice.top_logprobs
                    )
                    await self._send(out, data)
                calls = message.get("tool_calls")
                if calls:
                    deltas = [{"index": j, **c} for j, c in enumerate(calls)]
                    await self._send(out, chunk(i, delta={"tool_calls": deltas}))
                last = {"delta": {}} if chat else {"text": ""}
                await self._send(
                    out,
                    chunk(
                        i,
                        **last,
                        finish_reason=finish,
                        token_ids=choice.ids,
                        **self._versions(choice.generation, len(choice.ids)),
                    ),
                )
            if include_usage:
                await self._send(out, {**base, "choices": [], "usage": usage})
            await self._send(out, "[DONE]")
            await out.write_eof()
        return out

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


class _Call:
    """One generation call as the routes and the stream see it."""

    def __init__(
        self,
        kind: str,
        body: ChatRequest | CompletionRequest,
        logprobs: bool,
        top: int,
        tools: bool,
    ) -> None:
        self.kind, self.body, self.logprobs, self.top, self.tools = kind, body, logprobs, top, tools
        self.prompt: list[int] = []
        self.max_tokens = 1
        self.param = "messages"
