"""Message RPC over inproc://, tcp:// and ipc://: payloads, errors, timeouts, concurrency,
cancellation, chunking, size limits, exactly-once handling and statistics.

Security lives in ``test_rpc_security.py``; killed and restarted peers in ``test_rpc_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pynng
import pytest
import torch

from relax.errors import CallTimeout, MessageTooLarge, PeerGone, RemoteError, VersionGone
from relax.transport import Client, Limits, Peer, Server, connect, serve
from relax.transport._rpc_frames import PART, REFUSED, RESULT, STALE, encode
from tests.actors.helpers import wait_until
from tests.transport.rpc_helpers import RawClient, frame, part_header

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["inproc", "tcp", "ipc"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "inproc":
        return f"inproc://test-{uuid.uuid4().hex}"
    if request.param == "tcp":
        return "tcp://127.0.0.1:0"
    return f"ipc://{tmp_path}/rpc.sock"


@pytest.fixture(params=["tcp", "ipc"])
def nng_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/rpc.sock"


@contextlib.asynccontextmanager
async def running(url: str, handler: Any, **kw: Any) -> AsyncIterator[Server]:
    server = await serve(url, handler, **kw)
    try:
        yield server
    finally:
        await server.aclose()


@contextlib.asynccontextmanager
async def client_of(server: Server, **kw: Any) -> AsyncIterator[Client]:
    client = await connect(server.url, **kw)
    try:
        yield client
    finally:
        await client.aclose()


async def echo(payload: Any, peer: Peer) -> Any:
    return payload


# --------------------------------------------------------------------------- basics


async def test_payloads_round_trip_and_the_handler_sees_the_peer(url: str) -> None:
    peers: list[Peer] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        peers.append(peer)
        return payload

    payload = {
        "ints": [1, 2, 3],
        "text": "héllo",
        "raw": b"\x00\xff" * 10,
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "nested": {"f": 1.5, "none": None, "ids": torch.tensor([7, 8])},
    }
    async with running(url, handler) as server, client_of(server, client_id="alice") as client:
        if url.startswith("tcp"):
            assert not server.url.endswith(":0")  # port 0 resolved to the real port
        out = await client.request(payload)
        assert await client.request(None) is None
        assert await client.request(b"") == b""
    assert out["ints"] == [1, 2, 3] and out["text"] == "héllo" and out["raw"] == payload["raw"]
    assert torch.equal(out["t"], payload["t"]) and torch.equal(
        out["nested"]["ids"], payload["nested"]["ids"]
    )
    assert {p.id for p in peers} == {"alice"}
    scheme = url.split(":", 1)[0]
    assert (
        peers[0].address == "inproc"
        if scheme == "inproc"
        else peers[0].address.startswith(f"{scheme}://")
    )


async def test_inproc_hands_objects_over_by_reference() -> None:
    seen: list[Any] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        seen.append(payload)
        return payload["t"]

    request = {"t": torch.zeros(3), "anything": object()}  # not even wire-encodable
    async with running("inproc://by-ref", handler) as server, client_of(server) as client:
        reply = await client.request(request)
    assert seen[0] is request and reply is request["t"]


async def test_handler_errors_come_back_rebuilt(url: str) -> None:
    class Custom(Exception):
        pass

    async def handler(payload: Any, peer: Peer) -> Any:
        if payload == "key":
            raise KeyError("missing")
        if payload == "gone":
            raise VersionGone("version 3 is gone")
        if payload == "custom":
            raise Custom("mine")
        return "fine"

    async with running(url, handler) as server, client_of(server) as client:
        with pytest.raises(KeyError):
            await client.request("key")
        with pytest.raises(VersionGone, match="version 3 is gone"):
            await client.request("gone")
        with pytest.raises(RemoteError) as info:
            await client.request("custom")
        assert info.value.remote_type.endswith("Custom") and "mine" in str(info.value)
        assert await client.request("ok") == "fine"  # the server and the client live on
        assert server.statistics()["errors"] == 3
        assert client.statistics()["errors"] == 3


async def test_a_request_without_reply_in_time_raises_call_timeout(url: str) -> None:
    release = asyncio.Event()
    calls: list[str] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        calls.append(payload)
        await release.wait()
        return payload

    async with running(url, handler) as server, client_of(server) as client:
        with pytest.raises(CallTimeout):
            await client.request("slow", timeout=0.2)
        release.set()
        assert await client.request("next", timeout=10) == "next"
        assert client.statistics()["timeouts"] == 1
    assert calls == ["slow", "next"]  # the timed-out request still ran, once


async def test_unsupported_url_schemes_and_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported URL"):
        await serve("http://127.0.0.1:80", echo)
    with pytest.raises(ValueError, match="unsupported URL"):
        await connect("udp://127.0.0.1:80")
    with pytest.raises(ValueError, match="concurrency"):
        await serve("inproc://x", echo, concurrency=0)
    with pytest.raises(ValueError):
        Limits(frame_bytes=10)


async def test_an_address_in_use_is_a_transport_error(nng_url: str) -> None:
    from relax.errors import TransportError

    async with running(nng_url, echo) as server:
        with pytest.raises(TransportError, match="cannot listen"):
            await serve(server.url, echo)
    async with running("inproc://taken", echo):
        with pytest.raises(TransportError, match="in use"):
            await serve("inproc://taken", echo)


async def test_connecting_to_nothing_raises_peer_gone(url: str) -> None:
    target = url if not url.startswith("tcp") else "tcp://127.0.0.1:1"  # nothing listens on 1
    with pytest.raises(PeerGone):
        await connect(target, connect_timeout=0.3)


# --------------------------------------------------------------------------- concurrency


async def test_requests_run_concurrently_up_to_the_limit(url: str) -> None:
    active = peak = 0
    release = asyncio.Semaphore(0)

    async def handler(payload: Any, peer: Peer) -> Any:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await release.acquire()
        active -= 1
        return payload

    total = 24
    async with running(url, handler, concurrency=4) as server:
        clients = [await connect(server.url, client_id=f"c{i}") for i in range(3)]
        try:
            tasks = [
                asyncio.create_task(clients[i % 3].request(i, timeout=30)) for i in range(total)
            ]
            for done in range(total):
                await wait_until(lambda d=done: active == min(4, total - d), what="4 handlers")
                if done == 0:
                    assert server.statistics()["in_flight"] == 4
                release.release()
            assert sorted(await asyncio.gather(*tasks)) == list(range(total))
        finally:
            for c in clients:
                await c.aclose()
    assert peak == 4


async def test_a_cancelled_request_leaves_the_client_usable(url: str) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(payload: Any, peer: Peer) -> Any:
        if payload == "block":
            started.set()
            await release.wait()
        return payload

    async with running(url, handler) as server, client_of(server) as client:
        task = asyncio.create_task(client.request("block"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with anyio.move_on_after(0.1) as scope:  # an anyio scope cancels it too
            await client.request("block")
        assert scope.cancelled_caught
        assert await client.request("after", timeout=10) == "after"
        release.set()
        await wait_until(lambda: client.statistics()["in_flight"] == 0)


async def test_the_request_deadline_and_outer_timeouts_do_not_mix(nng_url: str) -> None:
    async def handler(payload: Any, peer: Peer) -> Any:
        await asyncio.Event().wait()

    async with running(nng_url, handler) as server, client_of(server) as client:
        with anyio.move_on_after(0.1) as outer:  # the caller's scope fires first
            await client.request("x", timeout=30)
        assert outer.cancelled_caught and client.statistics()["timeouts"] == 0
        with anyio.fail_after(30):  # the request's own deadline fires first
            with pytest.raises(CallTimeout):
                await client.request("x", timeout=0.1)
        task = asyncio.current_task()
        assert getattr(task, "cancelling", lambda: 0)() == 0  # nothing left pending on us (3.11+)


async def test_cancellation_at_any_point_never_wedges_the_client(nng_url: str) -> None:
    """pynng loses a cancellation that races a completion; our channels must not."""
    async with running(nng_url, echo) as server, client_of(server) as client:
        rng = random.Random(7)
        for i in range(150):
            task = asyncio.create_task(client.request(i))
            for _ in range(rng.randrange(12)):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                assert await task == i  # either it finished first, or it was cancelled
        assert await client.request("alive", timeout=10) == "alive"
        assert client.statistics()["in_flight"] == 0


async def test_closing_a_client_fails_its_waiting_requests(url: str) -> None:
    from relax.errors import TransportError

    started = asyncio.Event()

    async def handler(payload: Any, peer: Peer) -> Any:
        started.set()
        await asyncio.Event().wait()

    async with running(url, handler) as server:
        client = await connect(server.url)
        pending = asyncio.create_task(client.request("x"))
        await started.wait()
        await client.aclose()
        with pytest.raises(TransportError, match="closed"):
            await pending
        with pytest.raises(TransportError, match="closed"):
            await client.request("y")


# --------------------------------------------------------------------------- statistics


async def test_statistics_on_both_ends(url: str) -> None:
    async with running(url, echo) as server, client_of(server) as client:
        for i in range(5):
            await client.request(i)
        s, c = server.statistics(), client.statistics()
    for key in ("requests", "replies", "bytes_in", "bytes_out", "errors", "auth_failures"):
        assert key in s
    for key in ("bad_frames", "in_flight", "clients"):
        assert key in s
    assert s["requests"] == 5 and s["replies"] == 5 and s["clients"] == 1 and s["in_flight"] == 0
    assert c["requests"] == 5 and c["replies"] == 5 and c["in_flight"] == 0 and c["connected"]
    if not url.startswith("inproc"):
        assert s["bytes_in"] > 0 and s["bytes_out"] > 0 and s["bytes_in"] == c["bytes_out"]


# --------------------------------------------------------------------------- chunking


@pytest.mark.parametrize(
    ("client_frame", "server_frame"), [(4096, 4096), (4096, 1 << 20), (1 << 20, 8192)]
)
async def test_large_messages_travel_in_frames_and_arrive_whole(
    nng_url: str, client_frame: int, server_frame: int
) -> None:
    received: list[torch.Tensor] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        received.append(payload["t"])
        return {"back": torch.arange(75_000, dtype=torch.int32), "n": payload["t"].numel()}

    t = torch.randint(0, 255, (100_000,), dtype=torch.uint8)
    async with (
        running(nng_url, handler, limits=Limits(frame_bytes=server_frame)) as server,
        client_of(server, limits=Limits(frame_bytes=client_frame)) as client,
    ):
        reply = await client.request({"t": t})
        stats = server.statistics()
    frame_bytes = min(client_frame, server_frame)
    assert len(received) == 1 and torch.equal(received[0], t)
    assert torch.equal(reply["back"], torch.arange(75_000, dtype=torch.int32))
    assert stats["frames_in"] >= 100_000 // frame_bytes  # the upload went in pieces
    assert stats["frames_out"] >= 300_000 // frame_bytes  # so did the reply
    assert stats["partials"] == 0


async def test_concurrent_chunked_requests_do_not_mix(nng_url: str) -> None:
    async def handler(payload: Any, peer: Peer) -> Any:
        return payload * 2

    limits = Limits(frame_bytes=2048)
    async with (
        running(nng_url, handler, limits=limits) as server,
        client_of(server, limits=limits) as client,
    ):
        tensors = [torch.full((5000 + i,), i, dtype=torch.int16) for i in range(12)]
        out = await asyncio.gather(*(client.request(t) for t in tensors))
    for i, t in enumerate(tensors):
        assert torch.equal(out[i], t * 2)


async def test_oversized_messages_fail_at_the_sender(url: str) -> None:
    async def handler(payload: Any, peer: Peer) -> Any:
        return bytes(payload) if isinstance(payload, int) else len(payload)

    small = Limits(frame_bytes=4096, max_message_bytes=50_000)
    async with (
        running(url, handler, limits=small) as server,
        client_of(server, limits=small) as client,
    ):
        if url.startswith("inproc"):  # sizes are not measured in-process: nothing is encoded
            assert await client.request(bytes(60_000)) == 60_000
            return
        frames_before = server.statistics()["frames_in"]
        with pytest.raises(MessageTooLarge):
            await client.request(bytes(60_000))
        assert server.statistics()["frames_in"] == frames_before  # nothing was sent
        with pytest.raises(MessageTooLarge, match="reply"):  # the server refuses to send it
            await client.request(60_000)
        assert await client.request(b"ok") == 2


async def test_each_side_enforces_its_own_limit(nng_url: str) -> None:
    async def handler(payload: Any, peer: Peer) -> Any:
        return bytes(payload) if isinstance(payload, int) else len(payload)

    server_limits = Limits(frame_bytes=4096, max_message_bytes=50_000)
    client_limits = Limits(frame_bytes=4096, max_message_bytes=20_000)
    async with (
        running(nng_url, handler, limits=server_limits) as server,
        client_of(server, limits=Limits(frame_bytes=4096)) as client,
    ):
        # The client learnt the server's limit when it connected and refuses before sending...
        with pytest.raises(MessageTooLarge, match="server 50000"):
            await client.request(bytes(60_000))
        # ...and a server whose limit it does not know refuses the upload itself.
        client._server_max = 1 << 30  # type: ignore[attr-defined]
        with pytest.raises(MessageTooLarge, match="max_message_bytes"):
            await client.request(bytes(60_000))
    async with (
        running(nng_url, handler) as server,
        client_of(server, limits=client_limits) as client,
    ):
        with pytest.raises(MessageTooLarge, match="reply"):  # too big for the client to take
            await client.request(30_000)
        assert await client.request(10_000) == bytes(10_000)


# --------------------------------------------------------------------------- exactly once


async def test_nng_resends_are_handled_once(nng_url: str) -> None:
    calls: list[Any] = []
    release = asyncio.Event()

    async def handler(payload: Any, peer: Peer) -> Any:
        calls.append(payload)
        await release.wait()
        return payload

    async with running(nng_url, handler) as server, client_of(server) as client:
        # NNG resends every 20 ms: contexts copy the socket's setting when they are made, and
        # resend timers are checked every "resend tick" (the first, already armed, is 1 s).
        client._sock.resend_time = 20  # type: ignore[attr-defined]
        pynng.lib.nng_socket_set_ms(client._sock.socket, b"req:resend-tick", 10)  # type: ignore[attr-defined]
        for channel in client._free:  # type: ignore[attr-defined]
            pynng.lib.nng_ctx_set_ms(channel._ctx[0], b"req:resend-time", 20)
        task = asyncio.create_task(client.request("once", timeout=30))
        await wait_until(lambda: server.statistics()["duplicates"] >= 3, what="resends")
        release.set()
        assert await task == "once"
        assert await client.request("twice", timeout=30) == "twice"
    assert calls == ["once", "twice"]


async def test_duplicates_get_the_same_reply_and_stale_ones_are_refused(nng_url: str) -> None:
    calls: list[Any] = []
    gate = asyncio.Event()

    async def handler(payload: Any, peer: Peer) -> Any:
        calls.append(payload)
        if payload == "gated":
            await gate.wait()
        return {"reply-to": payload, "n": len(calls)}

    session = uuid.uuid4().bytes
    async with running(nng_url, handler) as server:  # noqa: SIM117 (b needs server.url)
        async with RawClient(server.url) as a, RawClient(server.url) as b:
            first = await a.request(frame(part_header(session, 0, "x", ack_below=0), "x"))
            again = await a.request(frame(part_header(session, 0, "x", ack_below=0), "x"))
            assert first == again and first[0][0] == RESULT
            # A duplicate of a request still running waits for the very same reply.
            header = part_header(session, 1, "gated", ack_below=0)
            t1 = asyncio.create_task(a.request(frame(header, "gated")))
            await wait_until(lambda: "gated" in calls)
            t2 = asyncio.create_task(b.request(frame(header, "gated")))
            await wait_until(lambda: server.statistics()["duplicates"] == 2)
            gate.set()
            r1, r2 = await t1, await t2
            assert r1 == r2 and r1[0][0] == RESULT
            # Once the client says it has everything below 2, a late copy of 0 is stale.
            await a.request(frame(part_header(session, 2, "y", ack_below=2), "y"))
            stale = await a.request(frame(part_header(session, 0, "x", ack_below=0), "x"))
            assert stale[0][:2] == [REFUSED, STALE]
    assert calls == ["x", "gated", "y"]


async def test_replies_are_dropped_once_acknowledged(nng_url: str) -> None:
    async def handler(payload: Any, peer: Peer) -> Any:
        return bytes(10_000)

    async with running(nng_url, handler) as server, client_of(server) as client:
        await asyncio.gather(*(client.request(i) for i in range(20)))
        await client.request("last")  # carries the acknowledgements of the 20
        (session,) = server._sessions.values()  # type: ignore[attr-defined]
        assert session.bodies <= 1


async def test_a_half_uploaded_request_is_dropped_after_a_timeout(nng_url: str) -> None:
    calls: list[Any] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        calls.append(payload)
        return "ok"

    async with running(nng_url, handler) as server:
        server.partial_timeout = 0.2  # type: ignore[attr-defined]
        parts, size = encode(torch.ones(10_000, dtype=torch.uint8))
        data = b"".join(bytes(p) for p in parts)
        header = [PART, "raw", uuid.uuid4().bytes, 0, 0, [], 0, size, 1 << 20]
        async with RawClient(server.url) as raw:
            reply = await raw.request(frame(header, raw=data[:4096]))
            assert reply[0] == [13]  # ACK: stored, waiting for the rest
            assert server.statistics()["partials"] == 1
            await wait_until(lambda: server.statistics()["partials"] == 0, what="drop")
            assert server.statistics()["partials_dropped"] == 1
            # The rest arriving later finds nothing to complete and is told to start over.
            header[6] = 4096
            again = await raw.request(frame(header, raw=data[4096:]))
            assert again[0][:2] == [REFUSED, "restart"]
    assert calls == []


# --------------------------------------------------------------------------- inproc restarts


async def test_inproc_requests_wait_for_a_server_to_come_back() -> None:
    name = f"inproc://{uuid.uuid4().hex}"
    started = asyncio.Event()

    async def blocking(payload: Any, peer: Peer) -> Any:
        started.set()
        await asyncio.Event().wait()

    first = await serve(name, blocking)
    client = await connect(name, connect_timeout=0.3)
    try:
        pending = asyncio.create_task(client.request("x", timeout=30))
        await started.wait()
        await first.aclose()  # the request is sent again to whoever takes the name next
        second = await serve(name, echo)
        assert await pending == "x"
        await second.aclose()
        with pytest.raises(PeerGone):
            await client.request("y")  # no timeout: waits connect_timeout for a server
        with pytest.raises(PeerGone):
            await client.request("y", timeout=0.2)
    finally:
        await client.aclose()


def test_the_dedup_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from relax.transport import _rpc_dedup
    from relax.transport._rpc_dedup import Reply, Session

    monkeypatch.setattr(_rpc_dedup, "REPLY_CACHE", 4)
    monkeypatch.setattr(_rpc_dedup, "REMEMBERED_IDS", 10)
    s = Session("c")
    for rid in range(30):  # the client never acknowledges anything (one request stuck at 0)
        s.inflight[rid] = None
        s.complete(rid, Reply(True, rid))
    assert s.bodies == 4 and len(s.done) == 10  # bodies and ids both capped
    assert [r for r, reply in s.done.items() if reply is not None] == [26, 27, 28, 29]
    assert s.done[20] is None  # remembered without its body: a duplicate is refused, not re-run
    s.forget([28, 29, 999])  # acknowledged by the client: bodies go
    assert s.bodies == 2 and s.done[28] is None
    s.advance(25)  # everything below 25 was received or given up by the client
    assert min(s.done) == 25 and s.floor == 25
    s.inflight[3] = None
    s.complete(3, Reply(True, 3))  # finished after its client gave up: not kept
    assert 3 not in s.done and 3 not in s.inflight
