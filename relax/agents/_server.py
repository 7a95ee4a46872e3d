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
``token_versions`` (the ``openai`` client keeps them in ``model_extra``). This module is the
HTTP side (routes, auth, errors, sessions, sampling); the bodies and events answered are
rendered by ``relax.agents._render``.

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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import quote

from aiohttp import web
from pydantic import BaseModel, ValidationError

from relax.agents._chat import ChatFormatError
from relax.agents._protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    FinishRequest,
    SamplingFields,
    validation_error,
)
from relax.agents._render import Call, Render, SseStream, relax_fields
from relax.agents._sampler import Sampler
from relax.agents._sessions import Choice, SessionStore
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
        self.render = Render(tokenizer, model_name)
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
        self, call: Call, on_event: Callable[[TokenEvent], Awaitable[None]] | None = None
    ) -> list[Generation]:
        """The call's generations; ``on_event`` hears each token as it is sampled (awaited in
        order, so a slow client slows only its own stream)."""
        assert call.params is not None
        queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        task = asyncio.ensure_future(
            self.sampler.generate(
                call.prompt,
                call.params,
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
        call = Call("chat", body, bool(body.logprobs), top, use_tools, param="messages")

        def prompt() -> list[int]:
            try:
                return self.sessions.chat_prompt(session_id, messages, tools)
            except ChatFormatError as exc:
                raise ApiError(400, str(exc), param="messages") from None

        requested = body.max_completion_tokens or body.max_tokens
        return await self._answer(request, call, session_id, prompt, requested)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await self._body(request, CompletionRequest)
        self._check_sampling(body)
        session_id = self._session_of(request)
        top = body.logprobs or 0
        call = Call("completions", body, body.logprobs is not None, top, False, param="prompt")

        def prompt() -> list[int]:
            return self.sessions.completion_prompt(session_id, body.prompt)

        return await self._answer(request, call, session_id, prompt, body.max_tokens)

    async def _answer(
        self,
        request: web.Request,
        call: Call,
        session_id: str | None,
        prompt: Callable[[], list[int]],
        requested: int | None,
    ) -> web.StreamResponse:
        """Sample ``call`` (holding its session, whose state ``prompt`` continues) and answer
        it, streamed or as one body; ``requested``: the request's ``max_tokens``."""
        async with self._hold(session_id):
            call.prompt = prompt()
            budget = self._budget(len(call.prompt), requested, call.param)
            call.params = call.body.sampling_params(
                max_tokens=budget,
                top_logprobs=call.top,
                stop_token_ids=self.stop_token_ids,
                param=call.param,
            )
            if call.body.stream:
                return await self._stream(request, call, session_id)
            gens = await self._generate(call)
            choices, finishes = self.render.choices(call, gens)
            self.sessions.record(session_id, choices)
        usage = self._usage(call.prompt, choices)
        relax = relax_fields(session_id, gens, self.sampler.version)
        return web.json_response(self.render.response(call, choices, finishes, usage, relax))

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self, request: web.Request, call: Call, session_id: str | None
    ) -> web.StreamResponse:
        """Serve a streamed call (holding its session): chunks go out as tokens are sampled
        (see ``SseStream``); a client gone mid-stream records nothing."""
        stream = SseStream(
            self.render, call, session_id, self.sampler.version, lambda: self._open_stream(request)
        )
        try:
            gens = await self._generate(call, stream.on_event)
        except ApiError as exc:
            if stream.response is None:
                raise
            with contextlib.suppress(ConnectionError):
                await stream.fail(exc.body())
            self._errors[exc.type] += 1
            return stream.response
        except ConnectionError:  # the client went away mid-stream: nothing is recorded
            self._stats["cancelled"] += 1
            assert stream.response is not None
            return stream.response
        choices, finishes = self.render.choices(call, gens)
        self.sessions.record(session_id, choices)
        usage = self._usage(call.prompt, choices)
        out = await stream.opened()
        with contextlib.suppress(ConnectionError):
            await stream.finish(choices, finishes, usage)
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
