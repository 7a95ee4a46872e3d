"""Stable handles to supervised actors: ``call`` (request/reply) and ``cast`` (fire-and-forget)."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from relax.errors import CallTimeout

DEFAULT_CALL_TIMEOUT = 30.0

# (rank, seconds left or None) -> the live member, waiting through a restart if one is under way.
Resolver = Callable[[int, float | None], Awaitable[Any]]


class ActorRef:
    """A handle that outlives restarts: it always talks to the child's current incarnation.

    - ``await ref.call("method", *args, timeout=..., **kwargs)`` returns the handler's result
      or raises its exception. ``CallTimeout`` after ``timeout`` seconds (the ref's default if
      omitted, ``math.inf`` for none); ``ActorDead`` if the actor died with the request in
      flight, or is gone for good. While the child is being restarted, a call waits for the
      new incarnation within its timeout instead of failing.
    - ``await ref.cast("method", *args, **kwargs)`` returns once the message is in the mailbox
      (it waits for space: backpressure, never a silent drop).

    ``timeout`` is reserved by ``call``; a handler cannot receive a keyword of that name.
    """

    def __init__(
        self,
        actor_id: str,
        resolve: Resolver,
        *,
        rank: int = 0,
        default_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        self.id = actor_id
        self._resolve = resolve
        self._rank = rank
        self.default_timeout = default_timeout

    def __repr__(self) -> str:
        rank = f" rank={self._rank}" if self._rank else ""
        return f"<ActorRef {self.id}{rank}>"

    def rank(self, rank: int) -> ActorRef:
        """A ref to one member of a gang (the plain ref talks to rank 0)."""
        return ActorRef(self.id, self._resolve, rank=rank, default_timeout=self.default_timeout)

    def with_timeout(self, timeout: float) -> ActorRef:
        """The same actor with another default call timeout."""
        return ActorRef(self.id, self._resolve, rank=self._rank, default_timeout=timeout)

    async def call(
        self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        limit = self.default_timeout if timeout is None else timeout
        deadline = None if math.isinf(limit) else time.monotonic() + limit
        member = await self._resolve(self._rank, limit if deadline is not None else None)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise CallTimeout(f"{self.id}.{method}: no live incarnation within {limit}s")
        return await member.call(method, args, kwargs, left)

    async def cast(self, method: str, *args: Any, **kwargs: Any) -> None:
        member = await self._resolve(self._rank, self.default_timeout)
        await member.cast(method, args, kwargs)
