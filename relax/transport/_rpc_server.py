"""The server side of RPC over NNG (``tcp://``, ``ipc://``): a REP socket served through contexts.

``concurrency`` receiver loops each hold an NNG context (a ``_rpc_aio.Channel``): receive a
frame, handle it, reply, repeat, the way a raw REP loop does (no task switch per request).
Control frames (handshake, upload parts, reply pulls) are answered on the spot; a complete
request runs the handler inline, so at most ``concurrency`` handlers run at once and further
frames wait in NNG (backpressure) until a loop is free.

Exactly-once: every request carries ``(session, rid)`` (a random per-``Client`` session, a
per-session counter). NNG's REQ resends requests (after a reconnect, or on its resend timer),
so a duplicate of a request being handled waits (in a task of its own) for the same reply, a
duplicate of a finished one gets the cached reply, and one its client already gave up on is
refused as stale; a handler never runs twice for one request while the server lives. What is
remembered, and for how long, is in ``_rpc_dedup``; sessions idle for ``session_ttl`` seconds
are forgotten.

Requests larger than a frame are reassembled in ``_rpc_dedup.Partial`` buffers, handed to the
handler only when complete, and dropped when their connection goes away or after
``partial_timeout`` seconds without a new part. A buffer grows as bytes arrive (the size a
first frame announces is not memory), and ``Limits`` caps how many uploads one connection and
the whole server may hold half-received, and their bytes: what goes past a cap is refused
(``busy``) and its upload dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from urllib.parse import urlsplit

import pynng

from relax.errors import MessageTooLarge, TransportError, error_to_dict
from relax.log import get_logger
from relax.transport import _auth
from relax.transport._rpc_aio import Channel, Closed
from relax.transport._rpc_base import Handler, Limits, Peer, Server, cancel_and_wait
from relax.transport._rpc_dedup import Partial, Reply, Session
from relax.transport._rpc_frames import (
    ACK,
    AUTH,
    BAD,
    BUSY,
    CHALLENGE,
    CHUNK,
    EVICTED,
    GONE,
    HEADER_ROOM,
    HELLO,
    MAX_ACKS,
    MAX_CLIENT_ID,
    PART,
    PROOF,
    PULL,
    REFUSED,
    REHELLO,
    RESTART,
    RESULT,
    SESSION_BYTES,
    STALE,
    TOO_LARGE,
    UNAUTHENTICATED,
    WELCOME,
    BadFrame,
    Parts,
    close_quietly,
    message,
    parse,
)
from relax.transport._wire import loads

log = get_logger("relax.transport")

SEND_TIMEOUT_MS = 30_000  # a peer that does not read its replies cannot hold a context forever


class NngServer(Server):
    """An RPC server on an NNG REP socket; see the module docstring."""

    def __init__(
        self,
        url: str,
        handler: Handler,
        *,
        secret: bytes | None,
        limits: Limits,
        concurrency: int,
        raw_tensors: bool = False,
    ) -> None:
        self.url = url
        self._raw_tensors = raw_tensors
        self._scheme = urlsplit(url).scheme
        self._handler = handler
        self._secret = secret
        self._limits = limits
        self._concurrency = concurrency
        self._loop = asyncio.get_running_loop()
        self._sock: pynng.Rep0 | None = None
        self._free: list[Channel] = []
        self._channels: set[Channel] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._authed: set[int] = set()
        self._challenges: dict[int, tuple[bytes, bytes]] = {}
        self._addresses: dict[int, str] = {}
        self._sessions: dict[bytes, Session] = {}
        self._partials: dict[tuple[bytes, int], Partial] = {}
        self._partial_bytes = 0  # bytes held in `_partials`' buffers
        self._in_flight = 0
        self._closed = False
        self.partial_timeout = 30.0
        """Seconds an incomplete upload may sit idle before it is dropped."""
        self.session_ttl = 600.0
        """Seconds an idle client session's dedup state is kept."""
        self._stats = dict.fromkeys(
            (
                "requests",
                "replies",
                "errors",
                "duplicates",
                "bytes_in",
                "bytes_out",
                "frames_in",
                "frames_out",
                "auth_failures",
                "bad_frames",
                "partials_dropped",
                "partials_refused",
            ),
            0,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        fb = self._limits.frame_bytes
        sock = pynng.Rep0(recv_max_size=fb + HEADER_ROOM, send_timeout=SEND_TIMEOUT_MS)
        sock.add_post_pipe_remove_cb(self._on_pipe_removed)
        try:
            listener = sock.listen(self.url)
        except pynng.NNGException as exc:
            close_quietly(sock)
            raise TransportError(f"cannot listen on {self.url}: {exc}") from exc
        self._sock = sock
        if self._scheme.startswith("tcp"):
            # str() and not .port: pynng 0.9 reports .port in network byte order.
            port = str(listener.local_address).rsplit(":", 1)[1]
            host = urlsplit(self.url).hostname or ""
            host = f"[{host}]" if ":" in host else host
            self.url = f"{self._scheme}://{host}:{port}"
        for _ in range(self._concurrency):
            self._spawn(self._receive())
        self._spawn(self._janitor())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Closing the channels wakes every receive and send parked in NNG with Closed.
        for channel in list(self._channels):
            channel.close()
        if self._sock is not None:
            close_quietly(self._sock)
        await cancel_and_wait(self._tasks)

    def statistics(self) -> dict[str, Any]:
        return {
            **self._stats,
            "in_flight": self._in_flight,
            "clients": len(self._sessions),
            "connections": len(self._sock.pipes) if self._sock is not None else 0,
            "partials": len(self._partials),
            "partial_bytes": self._partial_bytes,
        }

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _channel(self) -> Channel:
        if self._free:
            return self._free.pop()
        if self._closed or self._sock is None:
            raise Closed(f"rpc server {self.url} is closed")
        channel = Channel(self._sock, self._loop)
        self._channels.add(channel)
        return channel

    # ------------------------------------------------------------------ pipes

    def _on_pipe_removed(self, pipe: pynng.Pipe) -> None:
        # Called on an NNG thread: hop onto the event loop.
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._pipe_gone, pipe.id)

    def _pipe_gone(self, pipe_id: int) -> None:
        self._authed.discard(pipe_id)
        self._challenges.pop(pipe_id, None)
        self._addresses.pop(pipe_id, None)
        # A half-received message is never handed over: its sender is gone.
        for key in [k for k, p in self._partials.items() if p.pipe == pipe_id]:
            self._drop_partial(key)

    def _address(self, pipe_id: int, pipe: Any) -> str:
        address = self._addresses.get(pipe_id)
        if address is None:
            try:
                remote = str(pynng.Pipe(pipe, self._sock).remote_address)
            except Exception:  # the pipe went away under us
                remote = "?"
            address = f"{self._scheme}://{remote}"
            if pipe_id >= 0:
                self._addresses[pipe_id] = address
        return address

    async def _janitor(self) -> None:
        """Drop stale partial uploads, idle sessions and state of pipes that went away."""
        while True:
            await asyncio.sleep(max(0.01, min(1.0, self.partial_timeout / 4)))
            now = time.monotonic()
            for key in [
                k for k, p in self._partials.items() if now - p.touched > self.partial_timeout
            ]:
                self._drop_partial(key)
            for key in [
                k
                for k, s in self._sessions.items()
                if not s.inflight and now - s.last_seen > self.session_ttl
            ]:
                del self._sessions[key]
            assert self._sock is not None
            live = {p.id for p in self._sock.pipes}
            for pipe_id in (set(self._authed) | set(self._addresses)) - live:
                self._pipe_gone(pipe_id)

    # ------------------------------------------------------------------ receiving

    async def _receive(self) -> None:
        """One of ``concurrency`` loops: receive a frame, handle it (running the handler
        inline, as a raw REP loop would), reply, repeat. So at most ``concurrency`` handlers
        run at once, and a request costs no task switch beyond NNG's own."""
        channel: Channel | None = None
        while True:
            try:
                if channel is None:
                    channel = self._channel()
                view, pipe_id, pipe = await channel.recv("rpc server receive")
            except Closed:
                return
            except TransportError as exc:
                log.warning("rpc server receive failed", url=self.url, error=str(exc))
                continue
            try:
                if await self._dispatch(channel, view, pipe_id, pipe):
                    channel = None  # a task took it over to reply later
            except Closed:
                return
            except TransportError as exc:  # a reply could not be sent
                log.debug("rpc server could not reply", url=self.url, error=str(exc))
            except Exception:  # a bug here must not take a receiver loop with it
                log.exception("rpc server failed on a frame", url=self.url)
            # Free NNG's message now, not when this loop's next frame arrives: with many loops
            # idle, holding on would keep many frames resident and every new one cache-cold.
            view = pipe = None

    async def _dispatch(self, ch: Channel, view: memoryview, pipe_id: int, pipe: Any) -> bool:
        """Handle one frame; True if a task took over ``ch`` to reply later."""
        self._stats["frames_in"] += 1
        try:
            header, data = parse(view)
            self._stats["bytes_in"] += data.nbytes
            kind = header[0]
            if kind == HELLO:
                await self._hello(ch, pipe_id, header[1])
                return False
            if kind == PROOF:
                await self._proof(ch, pipe_id, pipe, header[1])
                return False
            if kind not in (PART, PULL):
                raise BadFrame(f"a client does not send frames of kind {kind}")
            if self._secret is not None and pipe_id not in self._authed:
                self._stats["auth_failures"] += 1
                log.warning(
                    "refused a request on an unauthenticated connection",
                    url=self.url,
                    peer=self._address(pipe_id, pipe),
                )
                await self._refuse(ch, UNAUTHENTICATED, "authenticate this connection first")
                return False
            if kind == PULL:
                await self._pull(ch, header)
                return False
            return await self._part(ch, pipe_id, pipe, header, data)
        except BadFrame as exc:
            self._stats["bad_frames"] += 1
            n = self._stats["bad_frames"]
            if n <= 10 or n % 1000 == 0:  # a flood of junk must not flood the log
                log.warning(
                    "dropped a bad frame",
                    url=self.url,
                    peer=self._address(pipe_id, pipe),
                    error=str(exc),
                    bad_frames=n,
                )
            await self._refuse(ch, BAD, str(exc))
            return False

    async def _send(
        self, ch: Channel, header: list[Any], parts: Parts = (), start: int = 0, n: int = 0
    ) -> None:
        self._stats["frames_out"] += 1  # counted when handed to NNG
        self._stats["bytes_out"] += n
        await ch.send(message(header, parts, start, n), "rpc server reply")

    async def _refuse(self, ch: Channel, code: str, text: str) -> None:
        await self._send(ch, [REFUSED, code, text])

    # ------------------------------------------------------------------ handshake

    async def _hello(self, ch: Channel, pipe_id: int, cnonce: bytes) -> None:
        limits = [self._limits.frame_bytes, self._limits.max_message_bytes]
        if self._secret is None:
            await self._send(ch, [CHALLENGE, None, None, *limits])
            return
        if cnonce and len(cnonce) != _auth.NONCE_BYTES:
            raise BadFrame("client nonce of the wrong length")
        if pipe_id < 0:  # a pipe NNG no longer knows: nothing to attach the handshake to
            await self._refuse(ch, REHELLO, "connection changed; start the handshake again")
            return
        snonce = _auth.nonce()
        self._challenges[pipe_id] = (cnonce, snonce)
        proof = _auth.server_proof(self._secret, cnonce, snonce) if cnonce else None
        await self._send(ch, [CHALLENGE, snonce, proof, *limits])

    async def _proof(self, ch: Channel, pipe_id: int, pipe: Any, proof: bytes) -> None:
        if self._secret is None:
            await self._send(ch, [WELCOME])
            return
        pending = self._challenges.pop(pipe_id, None)
        if pending is None:
            await self._refuse(ch, REHELLO, "no handshake in progress on this connection")
            return
        cnonce, snonce = pending
        if cnonce and _auth.same(proof, _auth.client_proof(self._secret, snonce, cnonce)):
            self._authed.add(pipe_id)
            await self._send(ch, [WELCOME])
            return
        self._stats["auth_failures"] += 1
        log.warning(
            "a client failed the handshake (wrong secret?)",
            url=self.url,
            peer=self._address(pipe_id, pipe),
        )
        await self._refuse(ch, AUTH, "authentication failed: the secrets differ")

    # ------------------------------------------------------------------ requests

    async def _part(
        self, ch: Channel, pipe_id: int, pipe: Any, header: list[Any], data: memoryview
    ) -> bool:
        _, client_id, session, rid, ack_below, acks, offset, total, max_chunk = header
        n = data.nbytes
        if not (
            len(client_id) <= MAX_CLIENT_ID
            and len(acks) <= MAX_ACKS
            and len(session) == SESSION_BYTES
            and rid >= 0
            and offset >= 0
            and offset + n <= total
            and (n > 0 or total == 0)
            and max_chunk >= 1024
        ):
            raise BadFrame("request part with inconsistent fields")
        sess = self._sessions.get(session)
        if sess is None:
            sess = self._sessions[session] = Session(client_id)
        sess.last_seen = time.monotonic()
        sess.advance(ack_below)
        if acks:
            sess.forget(acks)
        # Duplicates first: whatever part of a known request arrives, the answer is its reply.
        if rid in sess.done:
            reply = sess.done[rid]
            self._stats["duplicates"] += 1
            if reply is None:
                await self._refuse(ch, EVICTED, f"reply to request {rid} was evicted")
            else:
                await self._result(ch, reply, max_chunk)
            return False
        if rid in sess.inflight:
            self._stats["duplicates"] += 1
            pending = sess.inflight[rid]
            if pending is None:
                pending = sess.inflight[rid] = self._loop.create_future()
            self._spawn(self._reply_when_done(ch, pending, max_chunk))
            return True
        if rid < sess.floor:
            await self._refuse(ch, STALE, f"request {rid} was abandoned by its client")
            return False
        if total > self._limits.max_message_bytes:
            await self._refuse(
                ch,
                TOO_LARGE,
                f"request of {total} bytes exceeds the server's max_message_bytes="
                f"{self._limits.max_message_bytes}",
            )
            return False
        key = (session, rid)
        if offset == 0 and n == total:  # the common case: one frame, decoded from NNG's buffer
            body: Any = data
            self._drop_partial(key, dropped=False)
        else:
            part = self._partials.get(key)
            if offset == 0:
                self._drop_partial(key, dropped=False)  # the client starts it over
                refusal = self._partial_refusal(pipe_id)
                if refusal is not None:
                    self._stats["partials_refused"] += 1
                    await self._refuse(ch, BUSY, refusal)
                    return False
                part = self._partials[key] = Partial(total, pipe_id)
            elif part is None or part.total != total or offset > part.received:
                await self._refuse(ch, RESTART, "no partial upload here; send from offset 0")
                return False
            grow = max(0, offset + n - len(part.buf))
            if grow and self._partial_bytes + grow > self._partial_byte_cap():
                self._drop_partial(key)
                self._stats["partials_refused"] += 1
                await self._refuse(
                    ch,
                    BUSY,
                    f"the server holds {self._partial_bytes} bytes of partial uploads "
                    f"(max_partial_bytes={self._partial_byte_cap()}); send it again later",
                )
                return False
            # Grows the buffer by what arrived (a resent part overwrites in place).
            part.buf[offset : offset + n] = data
            self._partial_bytes += grow
            part.received = max(part.received, offset + n)
            part.touched, part.pipe = time.monotonic(), pipe_id
            if part.received < total:
                await self._send(ch, [ACK])
                return False
            self._drop_partial(key, dropped=False)
            body = part.buf
        del data
        sess.inflight[rid] = None  # a future is made only if a duplicate comes to wait
        peer = sess.peer
        if peer is None or sess.peer_pipe != pipe_id:
            peer = sess.peer = Peer(sess.client_id, self._address(pipe_id, pipe))
            sess.peer_pipe = pipe_id
        reply = await self._handle(sess, rid, body, peer)
        await self._result(ch, reply, max_chunk)
        return False

    def _partial_byte_cap(self) -> int:
        return max(self._limits.max_partial_bytes, self._limits.max_message_bytes)

    def _partial_refusal(self, pipe_id: int) -> str | None:
        """Why a new partial upload on ``pipe_id`` may not start, or ``None``."""
        limits = self._limits
        if len(self._partials) >= limits.max_partials:
            return (
                f"the server holds {len(self._partials)} partial uploads "
                f"(max_partials={limits.max_partials}); send it again later"
            )
        mine = sum(1 for p in self._partials.values() if p.pipe == pipe_id)
        if mine >= limits.max_partials_per_connection:
            return (
                f"this connection has {mine} partial uploads in progress "
                f"(max_partials_per_connection={limits.max_partials_per_connection}); "
                "finish one first"
            )
        return None

    def _drop_partial(self, key: tuple[bytes, int], *, dropped: bool = True) -> None:
        """Forget a partial upload (complete, restarted, or ``dropped``: counted)."""
        part = self._partials.pop(key, None)
        if part is not None:
            self._partial_bytes -= len(part.buf)
            if dropped:
                self._stats["partials_dropped"] += 1

    async def _handle(self, sess: Session, rid: int, body: Any, peer: Peer) -> Reply:
        """Run the handler on a complete request; record and return its reply."""
        self._stats["requests"] += 1
        self._in_flight += 1
        try:
            try:
                payload = loads(body, raw_tensors=self._raw_tensors)
                del body
                reply = Reply(True, await self._handler(payload, peer))
            except asyncio.CancelledError:
                if self._closed:
                    raise
                reply = self._error(asyncio.CancelledError("the handler was cancelled"))
            except Exception as exc:
                reply = self._error(exc)
            if reply.size > self._limits.max_message_bytes:
                reply = self._error(
                    MessageTooLarge(
                        f"reply of {reply.size} bytes exceeds the server's "
                        f"max_message_bytes={self._limits.max_message_bytes}"
                    )
                )
        except BaseException:
            waiting = sess.inflight.pop(rid, None)
            if waiting is not None:
                waiting.cancel()
            raise
        finally:
            self._in_flight -= 1
        waiting = sess.inflight.get(rid)
        sess.complete(rid, reply)
        if waiting is not None:
            waiting.set_result(reply)
        return reply

    def _error(self, exc: BaseException) -> Reply:
        self._stats["errors"] += 1
        return Reply(False, error_to_dict(exc))

    async def _reply_when_done(
        self, ch: Channel, future: asyncio.Future[Reply], max_chunk: int
    ) -> None:
        reply = await asyncio.shield(future)
        try:
            await self._result(ch, reply, max_chunk)
        except Closed:
            return
        except TransportError as exc:
            log.debug("rpc server could not reply", url=self.url, error=str(exc))
        self._free.append(ch)

    async def _result(self, ch: Channel, reply: Reply, max_chunk: int) -> None:
        n = min(max_chunk, self._limits.frame_bytes, reply.size)
        self._stats["replies"] += 1
        await self._send(ch, [RESULT, reply.ok, reply.size], reply.parts, 0, n)

    async def _pull(self, ch: Channel, header: list[Any]) -> None:
        _, session, rid, offset, max_chunk = header
        sess = self._sessions.get(session)
        reply = sess.done.get(rid) if sess is not None else None
        if reply is None:
            await self._refuse(ch, GONE, f"no reply to request {rid} here; send it again")
            return
        assert sess is not None
        sess.last_seen = time.monotonic()
        if not (0 <= offset < reply.size) or max_chunk < 1024:
            raise BadFrame("pull with inconsistent fields")
        n = min(max_chunk, self._limits.frame_bytes, reply.size - offset)
        await self._send(ch, [CHUNK, offset], reply.parts, offset, n)
