"""Many concurrent callers, one engine: requests that arrive while the engine is busy are
batched into its next ``generate`` call.

Episodes, agent sessions and endpoint requests each ask for one reply at a time; calling the
engine once per reply would leave it running batches of one. The sampler keeps a queue: when
the engine is free it takes everything waiting (grouped by ``SamplingParams``, since one engine
call has one set; the seed aside) and runs it as one batch. No timer decides the batch, so an
idle engine starts a lone request at once. Each request carries its own seed
(``SamplingParams.seed``, passed on as the engine's per-prompt ``seeds``), so its reply does not
depend on which other requests shared its batch. A request may carry its prompt's media
(``mm_inputs``); text and media requests share a batch (the engine takes media per prompt).

Streaming: a request with ``on_token`` hears each of its tokens as the engine samples it
(``TokenEvent.sequence`` is then the choice, 0 … n - 1), also when it shares a batch; an engine
that does not stream has its finished replies replayed as events, so callers have one path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from relax.engines import (
    EngineError,
    Generation,
    GenerationEngine,
    MediaInputs,
    SamplingParams,
    TokenEvent,
)

TokenCallback = Callable[[TokenEvent], None]
"""Hears one token of a request (``sequence`` = which of its ``n`` choices)."""


@dataclass
class _Request:
    prompt: list[int]
    key: SamplingParams
    """The request's sampling without its seed: requests with equal keys share a batch."""
    seed: int | None
    media: MediaInputs | None = None
    on_token: TokenCallback | None = None
    done: asyncio.Future[list[Generation]] = field(repr=False, default=None)  # type: ignore[assignment]


class Sampler:
    """Batches concurrent ``generate`` calls into engine calls (see the module docstring)."""

    def __init__(self, engine: GenerationEngine, *, max_batch: int = 64) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._queue: list[_Request] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.stats = {"requests": 0, "engine_calls": 0, "cancelled": 0, "largest_batch": 0}

    @property
    def version(self) -> int:
        """The weights version the engine serves now."""
        return self.engine.version

    def statistics(self) -> dict[str, Any]:
        """Requests served, engine calls made, requests waiting, largest batch."""
        return {**self.stats, "waiting": len(self._queue)}

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        mm_inputs: MediaInputs | None = None,
        on_token: TokenCallback | None = None,
    ) -> list[Generation]:
        """``params.n`` replies to one prompt (the engine's contract, for one prompt), seeded
        by ``params.seed``. ``mm_inputs``: the processor's tensors of the media whose
        placeholders ``prompt`` holds; ``on_token``: hears each token as it is sampled (see
        the module docstring)."""
        # ``params`` was validated when it was made, so a bad request fails alone (at its
        # caller) instead of failing the batch it would join.
        request = _Request(
            [int(t) for t in prompt],
            replace(params, seed=None),
            params.seed,
            dict(mm_inputs) if mm_inputs else None,
            on_token,
        )
        request.done = asyncio.get_running_loop().create_future()
        self._queue.append(request)
        self.stats["requests"] += 1
        self._ensure_running()
        try:
            return await request.done
        except asyncio.CancelledError:
            # Not yet started: it leaves the queue. Already in a batch: the batch finishes and
            # its result for this request is dropped.
            if request in self._queue:
                self._queue.remove(request)
            self.stats["cancelled"] += 1
            raise

    def _ensure_running(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._serve(), name="relax-sampler")

    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                first = self._queue[0].key
                batch = [r for r in self._queue if r.key == first][: self.max_batch]
                for r in batch:
                    self._queue.remove(r)
                await self._run(batch)

    async def _run(self, batch: list[_Request]) -> None:
        params = batch[0].key
        n = params.n
        seeded = any(r.seed is not None for r in batch)
        # Only what a batch uses is passed: an engine never sees an argument it need not know.
        extra: dict[str, Any] = {}
        if seeded:
            # An unseeded request in a seeded batch still gets a fresh seed of its own.
            extra["seeds"] = [r.seed if r.seed is not None else _fresh_seed() for r in batch]
        if any(r.media is not None for r in batch):
            extra["mm_inputs"] = [r.media for r in batch]
        listeners = [r.on_token for r in batch]
        streaming = any(listeners) and getattr(self.engine, "streams", False)
        if streaming:

            def on_token(events: list[TokenEvent]) -> None:
                for event in events:
                    i, k = divmod(event.sequence, n)
                    request = batch[i]
                    if request.on_token is not None and not request.done.done():
                        request.on_token(replace(event, sequence=k))

            extra["on_token"] = on_token
        self.stats["engine_calls"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
        try:
            gens = await self.engine.generate([r.prompt for r in batch], params, **extra)
        except asyncio.CancelledError:  # closing: nobody may wait forever
            for r in batch:
                _settle(r, exc=EngineError("the sampler was closed"))
            raise
        except EngineError as exc:
            if len(batch) > 1:  # find the request at fault: retry each alone
                for r in batch:
                    await self._run([r])
                return
            _settle(batch[0], exc=exc)
            return
        except Exception as exc:  # the engine broke: every caller hears it
            for r in batch:
                _settle(r, exc=exc)
            return
        for i, r in enumerate(batch):
            mine = gens[i * n : (i + 1) * n]
            if r.on_token is not None and not streaming and not r.done.done():
                _replay(r.on_token, mine)
            _settle(r, result=mine)

    async def aclose(self) -> None:
        """Stop serving; requests still waiting fail with ``EngineError``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in self._queue:
            _settle(r, exc=EngineError("the sampler was closed"))
        self._queue.clear()


def _settle(
    request: _Request, *, result: list[Generation] | None = None, exc: Exception | None = None
) -> None:
    if request.done.done():  # its caller was cancelled meanwhile
        return
    if exc is not None:
        request.done.set_exception(exc)
    else:
        request.done.set_result(result or [])


def _replay(on_token: TokenCallback, gens: list[Generation]) -> None:
    """A finished reply told as the events a streaming engine would have sent."""
    for k, gen in enumerate(gens):
        versions = gen.token_versions or [gen.version] * len(gen.response_ids)
        tops = gen.top_logprobs or [()] * len(gen.response_ids)
        for token, logprob, version, top in zip(
            gen.response_ids, gen.logprobs, versions, tops, strict=True
        ):
            on_token(TokenEvent(k, token, logprob, version, tuple(top)))


def _fresh_seed() -> int:
    import secrets

    return secrets.randbits(63)
