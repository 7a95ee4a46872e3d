"""The RPC vocabulary shared by every transport: limits, peers, and the server/client interface.

Transports (``_inproc``, ``_rpc_server``/``_rpc_client`` over NNG) implement :class:`Server` and
:class:`Client`; :mod:`relax.transport._rpc` picks one by URL scheme.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar


@dataclass(frozen=True)
class Limits:
    """Size limits of one endpoint (not measured for ``inproc://``, which copies nothing).

    Both ends enforce their own limits: the sender refuses to send a message above its
    ``max_message_bytes`` (``MessageTooLarge`` before anything is sent), the receiver refuses to
    reassemble one above its own. Frames are cut to the smaller ``frame_bytes`` of the two ends.
    """

    frame_bytes: int = 1 << 20
    """Encoded messages above this travel as several frames (chunks) and are reassembled."""
    max_message_bytes: int = 256 << 20
    """Encoded messages above this raise ``relax.errors.MessageTooLarge`` at the sending side."""
    max_partials_per_connection: int = 16
    """Requests one connection may have half-uploaded (several frames, not all in) at once; a
    server refuses to start another (``TransportError``, code ``busy``)."""
    max_partials: int = 256
    """Half-uploaded requests a server holds at once, over all its connections."""
    max_partial_bytes: int = 1 << 30
    """Bytes a server holds in half-uploaded requests, over all connections (never less than
    one ``max_message_bytes`` message). A buffer grows as its bytes arrive, never by the size
    a first frame announces; a part that would go past this is refused and its upload
    dropped."""

    def __post_init__(self) -> None:
        if self.frame_bytes < 1024:
            raise ValueError(f"frame_bytes must be at least 1024, got {self.frame_bytes}")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
        for name in ("max_partials_per_connection", "max_partials", "max_partial_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Peer:
    """Who sent a request, for logging and per-client state."""

    id: str
    """Stable client identity chosen by the client (survives reconnects)."""
    address: str
    """Where the request came from: ``tcp://127.0.0.1:53211``, ``ipc://...`` or ``inproc``."""


Handler = Callable[[Any, Peer], Awaitable[Any]]
"""A request handler: ``await handler(payload, peer)`` returns the reply payload or raises."""

_T = TypeVar("_T")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` (a snapshot: the set may shrink meanwhile) and wait until all ended;
    what a server does with the handler tasks still running when it closes."""
    snapshot = list(tasks)
    for task in snapshot:
        task.cancel()
    await asyncio.gather(*snapshot, return_exceptions=True)


class _AsyncClosing:
    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: _T) -> _T:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Server(_AsyncClosing, abc.ABC):
    """A running RPC server; made by :func:`relax.transport.serve`."""

    url: str
    """The actual URL clients connect to (a ``tcp://`` port 0 resolved to the real port)."""

    @abc.abstractmethod
    def statistics(self) -> dict[str, Any]:
        """Counters and gauges, all transports:

        ``requests`` handler runs, ``replies`` replies sent (errors included), ``errors``
        handler errors sent back, ``bytes_in``/``bytes_out`` payload bytes of frames (0 for
        inproc), ``auth_failures`` refused handshakes and unauthenticated requests,
        ``bad_frames`` malformed frames dropped, ``in_flight`` handlers running now,
        ``clients`` client sessions known. NNG servers add ``duplicates`` (resends answered
        from the dedup state), ``frames_in``/``frames_out``, ``partials`` (uploads being
        reassembled), ``partial_bytes`` (bytes they hold), ``partials_dropped``,
        ``partials_refused`` (over a ``Limits`` cap) and ``connections``.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop serving: handlers still running are cancelled, clients see the server gone."""


class Client(_AsyncClosing, abc.ABC):
    """A connection to an RPC server; made by :func:`relax.transport.connect`."""

    url: str
    client_id: str

    @abc.abstractmethod
    async def request(self, payload: Any, *, timeout: float | None = None) -> Any:
        """Send ``payload``, wait for the handler's reply and return it.

        Raises the handler's exception (rebuilt with ``relax.errors.error_from_dict``),
        ``CallTimeout`` when ``timeout`` passes while connected, ``PeerGone`` when the server
        stays away past ``timeout`` (or ``connect_timeout`` if no timeout is given),
        ``MessageTooLarge`` before sending a payload above the limits, ``AuthFailed`` when the
        secrets do not match.
        """

    @abc.abstractmethod
    def statistics(self) -> dict[str, Any]:
        """Counters and gauges: ``requests``, ``replies`` (successful), ``errors`` (handler
        errors received), ``timeouts`` (``CallTimeout``), ``peer_gone``, ``bytes_out``/
        ``bytes_in``, ``in_flight`` (requests waiting), ``connected``. NNG clients add
        ``frames_out``/``frames_in``, ``restarts`` (requests sent again from the start),
        ``handshakes`` and ``reconnects``.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the connection; requests still waiting fail with ``TransportError``."""
