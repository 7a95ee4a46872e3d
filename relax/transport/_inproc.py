"""``inproc://NAME``: RPC inside one process (one event loop), with no serialization at all.

Servers live in a process-global registry by name. A request object is handed to the handler
as is and so is the reply: tensors pass by reference, nothing is copied or encoded, and so
sizes are not measured either (``Limits`` do not apply and ``bytes_in``/``bytes_out`` stay 0).
Otherwise the semantics match the NNG transports: the handler runs in a task of the server
(a cancelled or timed-out request does not cancel it), at most ``concurrency`` at once; its
exception comes back rebuilt by ``relax.errors.error_from_dict``; a request waits for a server
that is not (or no longer) registered for up to its timeout (or ``connect_timeout``) and then
raises ``PeerGone``; a request whose server closes under it is sent again to the server that
takes the name next. Secrets are compared when a client first meets a server (both directions,
as over the network: a client with a secret refuses a server without one).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import math
from typing import Any

import anyio

from relax.errors import AuthFailed, CallTimeout, PeerGone, TransportError, error_from_dict
from relax.errors import error_to_dict as _error_to_dict
from relax.transport._rpc_base import Client, Handler, Peer, Server, cancel_and_wait

_servers: dict[str, InprocServer] = {}
_waiters: dict[str, set[asyncio.Future[None]]] = {}


class _ServerGone(Exception):
    """The server closed while handling the request."""


def _matches(a: bytes | None, b: bytes | None) -> bool:
    if a is None or b is None:
        return a is b
    return hmac.compare_digest(a, b)


class InprocServer(Server):
    """A server reachable as ``inproc://NAME`` from the same process."""

    def __init__(self, name: str, handler: Handler, *, secret: bytes | None, concurrency: int):
        self.url = f"inproc://{name}"
        self.name = name
        self._handler = handler
        self._secret = secret
        self._sem = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._clients: set[int] = set()
        self._closed = False
        self._in_flight = 0
        self._stats = dict.fromkeys(("requests", "replies", "errors", "auth_failures"), 0)

    def start(self) -> None:
        if self.name in _servers:
            raise TransportError(f"cannot serve {self.url}: address in use")
        _servers[self.name] = self
        for waiter in _waiters.pop(self.name, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if _servers.get(self.name) is self:
            del _servers[self.name]
        await cancel_and_wait(self._tasks)

    def statistics(self) -> dict[str, Any]:
        return {
            **self._stats,
            "bytes_in": 0,
            "bytes_out": 0,
            "bad_frames": 0,
            "in_flight": self._in_flight,
            "clients": len(self._clients),
        }

    def _check_secret(self, secret: bytes | None) -> None:
        if not _matches(self._secret, secret):
            self._stats["auth_failures"] += 1
            raise AuthFailed(f"{self.url}: the client's and the server's secrets differ")

    def _submit(self, payload: Any, peer: Peer) -> asyncio.Future[Any]:
        """Start the handler in a task of the server; its outcome lands in the future."""
        if self._closed:
            raise _ServerGone
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # A client that gave up never reads the outcome; do not warn about it.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        task = asyncio.create_task(self._run(payload, peer, future))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return future

    async def _run(self, payload: Any, peer: Peer, future: asyncio.Future[Any]) -> None:
        self._stats["requests"] += 1
        try:
            async with self._sem:
                self._in_flight += 1  # running handlers, as over NNG (waiting ones queue)
                try:
                    result = await self._handler(payload, peer)
                finally:
                    self._in_flight -= 1
        except asyncio.CancelledError:
            if self._closed:
                future.set_exception(_ServerGone())
                raise
            self._stats["errors"] += 1
            future.set_exception(_rebuilt(asyncio.CancelledError("the handler was cancelled")))
        except Exception as exc:
            self._stats["errors"] += 1
            future.set_exception(_rebuilt(exc))
        else:
            self._stats["replies"] += 1
            future.set_result(result)


def _relay(waiter: asyncio.Future[Any], future: asyncio.Future[Any]) -> None:
    """Pass the handler's outcome on to a client still waiting for it."""
    if waiter.done():
        return
    if future.cancelled():
        waiter.set_exception(_ServerGone())
    elif future.exception() is not None:
        waiter.set_exception(future.exception())  # type: ignore[arg-type]
    else:
        waiter.set_result(future.result())


def _rebuilt(exc: BaseException) -> BaseException:
    return error_from_dict(_error_to_dict(exc))


async def _wait_for_server(name: str, wait_s: float) -> InprocServer | None:
    server = _servers.get(name)
    if server is not None:
        return server
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _waiters.setdefault(name, set()).add(waiter)
    try:
        with anyio.move_on_after(wait_s):
            await waiter
    finally:
        waiters = _waiters.get(name)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del _waiters[name]
    return _servers.get(name)


class InprocClient(Client):
    """A client of an ``inproc://`` server."""

    def __init__(
        self, name: str, *, secret: bytes | None, client_id: str, connect_timeout: float
    ) -> None:
        self.url = f"inproc://{name}"
        self.client_id = client_id
        self._name = name
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._peer = Peer(client_id, "inproc")
        self._met: InprocServer | None = None
        self._closed = False
        self._in_flight = 0
        self._waiters: set[asyncio.Future[Any]] = set()
        self._stats = dict.fromkeys(("requests", "replies", "errors", "timeouts", "peer_gone"), 0)

    async def start(self) -> None:
        server = await _wait_for_server(self._name, self._connect_timeout)
        if server is None:
            raise PeerGone(f"no server at {self.url} within {self._connect_timeout}s")
        self._meet(server)

    def _meet(self, server: InprocServer) -> None:
        if server is not self._met:
            server._check_secret(self._secret)
            if self._met is not None:
                self._met._clients.discard(id(self))
            self._met = server
            server._clients.add(id(self))

    async def aclose(self) -> None:
        self._closed = True
        if self._met is not None:
            self._met._clients.discard(id(self))
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(TransportError(f"client of {self.url} is closed"))

    def statistics(self) -> dict[str, Any]:
        return {
            **self._stats,
            "bytes_in": 0,
            "bytes_out": 0,
            "in_flight": self._in_flight,
            "connected": self._name in _servers,
        }

    async def request(self, payload: Any, *, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        """Hand ``payload`` to the server's handler; see :class:`relax.transport.Client`."""
        if self._closed:
            raise TransportError(f"client of {self.url} is closed")
        self._stats["requests"] += 1
        self._in_flight += 1
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while True:
                remaining = math.inf if deadline is None else deadline - loop.time()
                server = _servers.get(self._name)
                if server is None:
                    wait = min(remaining, self._connect_timeout) if deadline is None else remaining
                    server = await _wait_for_server(self._name, max(0.0, wait))
                    if server is None:
                        self._stats["peer_gone"] += 1
                        raise PeerGone(f"no server at {self.url} (waited {wait:.3g}s)")
                    continue
                self._meet(server)
                try:
                    future = server._submit(payload, self._peer)
                except _ServerGone:
                    continue
                # Our own waiter: cancelling it (a timeout, the caller) leaves the handler be,
                # and aclose() can fail it.
                waiter: asyncio.Future[Any] = loop.create_future()
                future.add_done_callback(functools.partial(_relay, waiter))
                self._waiters.add(waiter)
                try:
                    with anyio.move_on_after(remaining) as scope:
                        try:
                            result = await waiter
                        except _ServerGone:
                            continue
                        except Exception:
                            self._stats["errors"] += 1
                            raise
                        self._stats["replies"] += 1
                        return result
                finally:
                    self._waiters.discard(waiter)
                if scope.cancelled_caught:
                    self._stats["timeouts"] += 1
                    raise CallTimeout(f"no reply from {self.url} within {timeout}s")
        finally:
            self._in_flight -= 1
