"""The client side of RPC over NNG (``tcp://``, ``ipc://``): a REQ socket used through contexts.

Every exchange takes a channel (an NNG context with its own aio, ``_rpc_aio.Channel``) from a
pool, so one client has any number of requests in flight on its one connection. A request whose encoded payload exceeds the frame size is
uploaded as several PART exchanges (the server acknowledges each; the last one's reply is the
result), and a reply larger than a frame arrives as its first chunk plus PULL exchanges.

Reconnection is NNG's: the dialer redials, and REQ resends a request whose connection died.
The server deduplicates (see ``_rpc_server``). On a new connection, a server with a secret
refuses requests until the client has done the handshake again, which the client does by
itself; a server that lost an upload or a reply (it restarted) says so, and the client sends
the request again from the start. So nothing is ever half-delivered.

Deadlines: a request with ``timeout`` fails after it (``PeerGone`` if the connection is down
then, else ``CallTimeout``). A request without one waits as long as the server works on it,
but no longer than ``connect_timeout`` while the connection is down (``PeerGone``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
from typing import Any

import anyio
import pynng

from relax.errors import (
    AuthFailed,
    CallTimeout,
    MessageTooLarge,
    PeerGone,
    TransportError,
    error_from_dict,
)
from relax.transport import _auth
from relax.transport._rpc_aio import Channel
from relax.transport._rpc_base import Client, Limits
from relax.transport._rpc_frames import (
    ACK,
    AUTH,
    CHALLENGE,
    CHUNK,
    GONE,
    HEADER_ROOM,
    HELLO,
    MAX_ACKS,
    PART,
    PROOF,
    PULL,
    REFUSED,
    REHELLO,
    RESTART,
    RESULT,
    SESSION_BYTES,
    TOO_LARGE,
    UNAUTHENTICATED,
    WELCOME,
    Parts,
    close_quietly,
    encode,
    message,
    parse,
)
from relax.transport._wire import loads

MAX_RESTARTS = 100
"""Times one request may start over (reconnects, a restarted server) before giving up."""
_AGAIN_CODES = frozenset({UNAUTHENTICATED, RESTART, GONE, REHELLO})


class _Deadline:
    """Cancels a request's task when its deadline passes, and knows that it did.

    What ``asyncio.timeout`` does, minus its cost, plus a deadline that moves: requests
    without a timeout get one only while the connection is down (``connect_timeout``).
    """

    __slots__ = ("fired", "handle", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.handle: asyncio.TimerHandle | None = None
        self.fired = False

    def move(self, loop: asyncio.AbstractEventLoop, when: float | None) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        if when is not None and not self.fired:
            self.handle = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.handle = None
        self.fired = True
        self.task.cancel()


class _Again(Exception):
    """The server lost track of this request (new connection, restarted): start it over."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class NngClient(Client):
    """An RPC client on an NNG REQ socket; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        secret: bytes | None,
        limits: Limits,
        client_id: str,
        connect_timeout: float,
    ) -> None:
        self.url = url
        self.client_id = client_id
        self._secret = secret
        self._limits = limits
        self._connect_timeout = connect_timeout
        self._session = os.urandom(SESSION_BYTES)
        self._loop = asyncio.get_running_loop()
        self._sock: pynng.Req0 | None = None
        self._free: list[Channel] = []
        self._channels: set[Channel] = set()
        self._next_rid = 0
        self._waiting: set[int] = set()
        self._heap: list[int] = []  # rids of `_waiting` (and finished ones, popped lazily)
        self._acks: list[int] = []  # finished rids the server may still hold replies for
        self._unbounded: set[_Deadline] = set()  # deadlines of requests without a timeout
        self._pipes: set[int] = set()
        self._trusted: set[int] = set()  # connections on which the server proved its secret
        self._ever_connected = False
        self._auth_lock = asyncio.Lock()
        self._auth_epoch = 0
        self._chunk = limits.frame_bytes
        self._server_max = limits.max_message_bytes
        self._closed = False
        self._stats = dict.fromkeys(
            (
                "requests",
                "replies",
                "errors",
                "timeouts",
                "peer_gone",
                "bytes_out",
                "bytes_in",
                "frames_out",
                "frames_in",
                "restarts",
                "handshakes",
                "reconnects",
            ),
            0,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        sock = pynng.Req0(
            recv_max_size=self._limits.frame_bytes + HEADER_ROOM,
            reconnect_time_min=20,
            reconnect_time_max=500,
        )
        sock.add_post_pipe_connect_cb(self._on_pipe_added)
        sock.add_post_pipe_remove_cb(self._on_pipe_removed)
        self._sock = sock
        try:
            try:
                sock.dial(self.url, block=False)  # redials by itself until a server is there
            except pynng.NNGException as exc:
                raise TransportError(f"cannot dial {self.url}: {exc}") from exc
            with anyio.move_on_after(self._connect_timeout) as scope:
                await self._authenticate()
            if scope.cancelled_caught:
                raise PeerGone(
                    f"no RPC server answered at {self.url} within {self._connect_timeout}s"
                )
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for channel in list(self._channels):  # wakes waiting requests with Closed
            channel.close()
        if self._sock is not None:
            close_quietly(self._sock)

    def statistics(self) -> dict[str, Any]:
        return {
            **self._stats,
            "in_flight": len(self._waiting),
            "connected": bool(self._pipes),
        }

    # ------------------------------------------------------------------ connection state

    def _on_pipe_added(self, pipe: pynng.Pipe) -> None:
        with contextlib.suppress(RuntimeError):  # NNG thread; the loop may be closed
            self._loop.call_soon_threadsafe(self._pipe_up, pipe.id)

    def _on_pipe_removed(self, pipe: pynng.Pipe) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._pipe_down, pipe.id)

    def _pipe_up(self, pipe_id: int) -> None:
        if not self._pipes and self._ever_connected:
            self._stats["reconnects"] += 1
        self._pipes.add(pipe_id)
        self._ever_connected = True
        for deadline in self._unbounded:
            deadline.move(self._loop, None)

    def _pipe_down(self, pipe_id: int) -> None:
        self._pipes.discard(pipe_id)
        self._trusted.discard(pipe_id)
        if not self._pipes and not self._closed:
            when = self._loop.time() + self._connect_timeout
            for deadline in self._unbounded:
                deadline.move(self._loop, when)

    # ------------------------------------------------------------------ requests

    async def request(self, payload: Any, *, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        """Send ``payload`` and return the reply; see :class:`relax.transport.Client`."""
        if self._closed:
            raise TransportError(f"client of {self.url} is closed")
        parts, size = encode(payload)
        limit = min(self._limits.max_message_bytes, self._server_max)
        if size > limit:
            raise MessageTooLarge(
                f"request of {size} bytes exceeds max_message_bytes={limit} "
                f"(client {self._limits.max_message_bytes}, server {self._server_max})"
            )
        rid = self._next_rid
        self._next_rid += 1
        self._waiting.add(rid)
        heapq.heappush(self._heap, rid)
        self._stats["requests"] += 1
        task = asyncio.current_task()
        assert task is not None
        deadline = _Deadline(task)
        if timeout is not None:
            deadline.move(self._loop, self._loop.time() + timeout)
        else:
            self._unbounded.add(deadline)
            if not self._pipes:
                deadline.move(self._loop, self._loop.time() + self._connect_timeout)
        try:
            return await self._run(rid, parts, size)
        except asyncio.CancelledError:
            if not deadline.fired:
                raise  # someone else cancelled us
            if hasattr(task, "uncancel"):  # Python 3.11+: the cancellation was ours, undo it
                task.uncancel()
        finally:
            deadline.move(self._loop, None)
            self._unbounded.discard(deadline)
            self._waiting.discard(rid)
            self._acks.append(rid)
            if len(self._heap) > 2 * len(self._waiting) + 1024:  # one request stuck for long
                self._heap = sorted(self._waiting)
        if timeout is None or not self._pipes:
            self._stats["peer_gone"] += 1
            waited = self._connect_timeout if timeout is None else timeout
            raise PeerGone(f"RPC server at {self.url} unreachable for {waited}s")
        self._stats["timeouts"] += 1
        raise CallTimeout(f"no reply from {self.url} within {timeout}s")

    def _ack_below(self) -> int:
        """The lowest request id still waiting: the server may forget replies below it."""
        heap = self._heap
        while heap and heap[0] not in self._waiting:
            heapq.heappop(heap)
        return heap[0] if heap else self._next_rid

    async def _run(self, rid: int, parts: Parts, size: int) -> Any:
        for _ in range(MAX_RESTARTS):
            epoch = self._auth_epoch
            try:
                ok, reply = await self._attempt(rid, parts, size)
            except _Again as again:
                self._stats["restarts"] += 1
                if again.code == UNAUTHENTICATED:
                    await self._reauthenticate(epoch)
                continue
            if ok:
                self._stats["replies"] += 1
                return loads(reply)
            self._stats["errors"] += 1
            raise error_from_dict(loads(reply))
        raise TransportError(f"request to {self.url} restarted {MAX_RESTARTS} times; giving up")

    async def _attempt(self, rid: int, parts: Parts, size: int) -> tuple[bool, Any]:
        """Upload the request, then download the reply: ``(ok, reply bytes)``."""
        offset, chunk = 0, self._chunk
        while True:
            n = min(chunk, size - offset)
            floor, acks = self._ack_below(), self._acks
            if acks:  # only the ones above the floor tell the server something new
                acks = [r for r in acks[:MAX_ACKS] if r >= floor]
                del self._acks[:MAX_ACKS]
            header = [PART, self.client_id, self._session, rid, floor, acks]
            header += [offset, size, self._limits.frame_bytes]
            head, body = self._trust(*await self._exchange(header, parts, offset, n))
            if head[0] == RESULT:
                break
            if head[0] == ACK and offset + n < size:
                offset += n
                continue
            self._refused(head)
        _, ok, total = head
        if total > self._limits.max_message_bytes:
            raise MessageTooLarge(
                f"reply of {total} bytes exceeds max_message_bytes={self._limits.max_message_bytes}"
            )
        if body.nbytes == total:
            return ok, body  # one frame: decoded straight from NNG's buffer
        if body.nbytes > total:
            raise TransportError(f"{self.url} sent a reply chunk longer than the reply")
        buf = bytearray(total)
        got = body.nbytes
        buf[:got] = body
        del body
        while got < total:
            header = [PULL, self._session, rid, got, self._limits.frame_bytes]
            head, body = self._trust(*await self._exchange(header))
            if head[0] != CHUNK:
                self._refused(head)
            if head[1] != got or body.nbytes == 0 or got + body.nbytes > total:
                raise TransportError(f"{self.url} sent a reply chunk out of place")
            buf[got : got + body.nbytes] = body
            got += body.nbytes
        return ok, buf

    def _refused(self, head: list[Any]) -> None:
        """Turn an unexpected frame (usually a REFUSED) into ``_Again`` or an error."""
        if head[0] != REFUSED:
            raise TransportError(f"{self.url} answered with an unexpected frame kind {head[0]}")
        code, text = head[1], head[2]
        if code in _AGAIN_CODES:
            raise _Again(code)
        if code == AUTH:
            raise AuthFailed(f"{self.url}: {text}")
        if code == TOO_LARGE:
            raise MessageTooLarge(f"{self.url}: {text}")
        raise TransportError(f"{self.url} refused the request ({code}): {text}")

    def _trust(self, head: list[Any], body: memoryview, pipe: int) -> tuple[list[Any], memoryview]:
        """With a secret, accept replies only from connections whose server proved it holds it.

        A server that restarted (or an impostor at the same address) is reached over a new
        connection; requests get refused there until the client handshakes again, but an
        impostor would not refuse, so the client checks on its side as well.
        """
        if self._secret is not None and pipe not in self._trusted:
            raise _Again(UNAUTHENTICATED)
        return head, body

    async def _exchange(
        self, header: list[Any], parts: Parts = (), start: int = 0, n: int = 0
    ) -> tuple[list[Any], memoryview, int]:
        """One REQ/REP round trip on a pooled channel: the reply's header, its data (a view of
        NNG's buffer that keeps the message alive) and the connection (pipe id) it came on."""
        if self._closed or self._sock is None:
            raise TransportError(f"client of {self.url} is closed")
        if self._free:
            channel = self._free.pop()
        else:
            channel = Channel(self._sock, self._loop)
            self._channels.add(channel)
        finished = False
        try:
            await channel.send(message(header, parts, start, n), f"request to {self.url}")
            view, pipe, _ = await channel.recv(f"reply from {self.url}")
            finished = True
        finally:
            if finished:
                self._free.append(channel)
            else:  # an interrupted exchange must not leak its late reply into the next one
                self._channels.discard(channel)
                channel.close()
        self._stats["frames_out"] += 1
        self._stats["frames_in"] += 1
        self._stats["bytes_out"] += n
        head, body = parse(view)
        self._stats["bytes_in"] += body.nbytes
        return head, body, pipe

    # ------------------------------------------------------------------ handshake

    async def _reauthenticate(self, epoch: int) -> None:
        """Handshake on a new connection, once for all the requests that were refused."""
        async with self._auth_lock:
            if self._auth_epoch == epoch:
                await self._authenticate()

    async def _authenticate(self) -> None:
        for _ in range(MAX_RESTARTS):
            try:
                await self._handshake()
            except _Again:
                continue
            self._auth_epoch += 1
            return
        raise TransportError(f"handshake with {self.url} kept restarting; giving up")

    async def _handshake(self) -> None:
        secret = self._secret
        cnonce = _auth.nonce() if secret is not None else b""
        head, _, hello_pipe = await self._exchange([HELLO, cnonce])
        if head[0] != CHALLENGE:
            self._refused(head)
        _, snonce, proof, frame_bytes, max_message = head
        self._chunk = max(1024, min(self._limits.frame_bytes, frame_bytes))
        self._server_max = max_message
        if secret is None:
            if snonce is not None:
                raise AuthFailed(f"{self.url} requires a shared secret; connect with secret=...")
            return
        if snonce is None or proof is None:
            raise AuthFailed(f"{self.url} has no secret, so it cannot prove it is the right server")
        if not _auth.same(proof, _auth.server_proof(secret, cnonce, snonce)):
            raise AuthFailed(f"{self.url} failed to prove it holds the secret: the secrets differ")
        proof = _auth.client_proof(secret, snonce, cnonce)
        head, _, proof_pipe = await self._exchange([PROOF, proof])
        if head[0] != WELCOME:
            self._refused(head)
        if proof_pipe != hello_pipe:  # the connection changed half-way: start over
            raise _Again(REHELLO)
        self._trusted.add(proof_pipe)
        self._stats["handshakes"] += 1
