"""``Policy``: the asyncio client a user's own program (an agent, a game, a sandbox) uses to
sample from the policy through the agent endpoint, and to score the sessions it plays::

    async with Policy(url, api_key) as policy:
        session = "episode-17"
        [reply] = await policy.chat(messages, tools=tools, session=session)
        ...                                   # act on reply.message, append, call again
        await policy.finish(session, reward=1.0)

Every call of a ``session`` is recorded into one trajectory on the server (token-exact, see
``relax.agents._sessions``); ``finish`` hands it to training with its reward. An unmodified
OpenAI client works too: give it ``base_url=policy.session_url(session)``.

Errors are mapped at the edge: an HTTP error answer is an ``AgentEndpointError`` (status, type,
param, message of the OpenAI error body); an endpoint that cannot be reached is ``PeerGone``;
no answer within ``timeout`` is ``CallTimeout``. A call cancelled mid-flight closes its
connection; the client stays usable. A client that knows its run (``connect``,
``relax.embed``'s ``run.policy()``) raises ``RunFinished`` instead once the run has ended —
the trainer finished its steps and the endpoint went away with the cluster — for the call that
met the closing endpoint and for every call after it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict
from urllib.parse import quote

import aiohttp

from relax.errors import AgentEndpointError, CallTimeout, PeerGone, RunFinished, TransportError

if TYPE_CHECKING:
    from typing_extensions import Unpack

RunEnded = Callable[[float], Awaitable[str | None]]
"""Asked after a call failed the way a closing endpoint fails it: within the given seconds,
has the run ended? Returns why (a sentence), or ``None`` while it goes on."""


class SamplingOptions(TypedDict, total=False):
    """The sampling keywords of ``Policy.generate`` and ``Policy.chat`` (OpenAI's fields)."""

    max_tokens: int
    """Most tokens per reply (default 64)."""
    temperature: float
    """Default 1.0; 0 is greedy."""
    top_p: float
    """Default 1.0 (off)."""
    n: int
    """Replies sampled (default 1)."""
    seed: int | None
    """The same seed, prompt and weights give the same replies (default: unseeded)."""
    stop: str | Sequence[str] | None
    """Strings that end a reply (it is cut after the token completing one)."""


_DEFAULTS: SamplingOptions = {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "n": 1}


@dataclass
class Completion:
    """One sampled continuation of a text (or token-id) prompt."""

    text: str
    token_ids: list[int]
    """The ids sampled (cut after the token completing a stop string, when one hit)."""
    logprobs: list[float]
    """The sampling policy's log-prob of each of ``token_ids``."""
    finish_reason: str
    """"stop" (a stop token or string) or "length" (``max_tokens``)."""
    version: int
    """The oldest weights version that sampled any of its tokens."""
    prompt_token_ids: list[int] = field(default_factory=list)
    """The ids it was sampled from (in a session: the whole trajectory so far)."""


@dataclass
class ChatReply:
    """One sampled assistant turn."""

    message: dict[str, Any]
    """OpenAI's assistant message: ``role``, ``content`` and, when it calls tools,
    ``tool_calls``; send it back as is to continue the session."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop", "length" or "tool_calls"."""
    version: int


class Policy:
    """An asyncio client of the agent endpoint at ``url`` (see the module docstring).

    Use it as ``async with Policy(...) as policy``; it owns one HTTP connection pool, opened
    on first use and closed on exit (or by ``aclose``). ``timeout``: seconds one call may take.
    ``run_ended``: how to tell that the run behind the endpoint has ended (then calls raise
    ``RunFinished``); ``grace``: how long a refused connection waits for that verdict.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout: float = 300,
        run_ended: RunEnded | None = None,
        grace: float = 15.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.run_ended = run_ended
        self.grace = grace
        self._finished: str | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Policy:
        self._client()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (a later call opens new ones)."""
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    def session_url(self, session: str) -> str:
        """The ``base_url`` to give an unmodified OpenAI client so that its calls are recorded
        into ``session``."""
        return f"{self.url}/sessions/{quote(session, safe='')}/v1"

    # ------------------------------------------------------------------ calls

    async def version(self) -> int:
        """The weights version the endpoint serves now."""
        return int((await self._call("GET", "/relax/v1/version"))["version"])

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        session: str | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> list[Completion]:
        """``n`` continuations of ``prompt`` (text, or token ids sent as they are), sampled as
        ``sampling`` says (``SamplingOptions``)."""
        text_or_ids = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        # logprobs 0: the sampled tokens' logprobs (no top-N alternatives).
        body = {"prompt": text_or_ids, "logprobs": 0}
        data = await self._sample("/v1/completions", session, body, sampling)
        out = []
        for choice in data["choices"]:
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            out.append(
                Completion(
                    text=choice["text"],
                    token_ids=list(choice.get("token_ids", [])),
                    logprobs=[float(x) for x in logprobs],
                    finish_reason=choice["finish_reason"],
                    version=_version(data, choice),
                    prompt_token_ids=list(data.get("prompt_token_ids", [])),
                )
            )
        return out

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        session: str | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> list[ChatReply]:
        """``n`` assistant replies to the conversation ``messages`` (OpenAI message dicts),
        sampled as ``sampling`` says (``SamplingOptions``)."""
        body = {
            "messages": list(messages),
            "logprobs": True,
            **_optional(tools=list(tools) if tools else None),
        }
        data = await self._sample("/v1/chat/completions", session, body, sampling)
        out = []
        for choice in data["choices"]:
            content = (choice.get("logprobs") or {}).get("content") or []
            out.append(
                ChatReply(
                    message=choice["message"],
                    token_ids=list(choice.get("token_ids", [])),
                    logprobs=[float(c["logprob"]) for c in content],
                    finish_reason=choice["finish_reason"],
                    version=_version(data, choice),
                )
            )
        return out

    async def finish(self, session: str, reward: float, **extra: Any) -> dict[str, Any]:
        """End ``session`` with ``reward`` (``choice=k``: which of the last call's ``n`` replies
        was the final turn; other keywords travel to the server's ``on_finish``). Returns the
        server's summary: ``session``, ``tokens``, ``turns``, ``version``."""
        path = f"/relax/v1/sessions/{quote(session, safe='')}/finish"
        return await self._call("POST", path, {**extra, "reward": float(reward)})

    # ------------------------------------------------------------------ plumbing

    async def _sample(
        self, path: str, session: str | None, body: dict[str, Any], sampling: SamplingOptions
    ) -> dict[str, Any]:
        """POST a generation request: ``body`` with the sampling fields (defaults filled in,
        unset ones left out), to ``path`` of ``session`` (or outside any)."""
        unknown = sorted(set(sampling) - SamplingOptions.__optional_keys__)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
        fields = {**_DEFAULTS, **sampling}
        return await self._call("POST", _route(path, session), {**body, **_optional(**fields)})

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._http = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout)
            )
        return self._http

    @property
    def finished(self) -> bool:
        """Whether this client has seen its run end (every call raises ``RunFinished``)."""
        return self._finished is not None

    async def _ended(self, what: str, within: float) -> None:
        """Raise ``RunFinished`` if the run has ended (waiting up to ``within`` seconds)."""
        if self._finished is None and self.run_ended is not None:
            self._finished = await self.run_ended(within)
        if self._finished is not None:
            raise RunFinished(f"{what}: the run has ended ({self._finished})")

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        url = self.url + path
        what = f"{method} {url}"
        if self._finished is not None:
            await self._ended(what, 0)
        http = self._client()
        try:
            async with http.request(method, url, json=body) as response:
                status = response.status
                raw = await response.read()
        except asyncio.TimeoutError:  # aiohttp's own timeouts (a caller's cancel is not one)
            raise CallTimeout(f"{method} {url}: no answer within {self.timeout}s") from None
        except aiohttp.ClientConnectionError as exc:
            # The endpoint closed: a run that finished, or a rollout that died (it restarts).
            await self._ended(what, self.grace)
            raise PeerGone(f"{method} {url}: the agent endpoint is unreachable: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise TransportError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if status >= 500:  # a request cut short by the endpoint closing looks like this too
            await self._ended(what, 0)
        if status >= 400:
            error = data.get("error") if isinstance(data, dict) else None
            if not isinstance(error, dict):
                error = {"message": raw.decode(errors="replace")[:1000] or f"HTTP {status}"}
            raise AgentEndpointError(
                str(error.get("message")),
                status=status,
                type=error.get("type"),
                param=error.get("param"),
                code=error.get("code"),
            )
        if not isinstance(data, dict):
            raise TransportError(f"{method} {url}: the answer is not a JSON object: {raw[:200]!r}")
        return data


def _route(path: str, session: str | None) -> str:
    return path if session is None else f"/sessions/{quote(session, safe='')}{path}"


def _optional(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _version(data: dict[str, Any], choice: dict[str, Any]) -> int:
    versions = choice.get("token_versions")
    if versions:
        return int(min(versions))
    return int((data.get("relax") or {}).get("version", -1))
