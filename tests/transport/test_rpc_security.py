"""RPC security: where a server may bind, the shared-secret handshake, impostors and junk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from typing import Any

import pytest
import structlog

from relax.errors import AuthFailed
from relax.transport import Limits, Peer, connect, serve
from relax.transport._auth import NONCE_BYTES
from relax.transport._rpc_frames import (
    BAD,
    CHALLENGE,
    CHUNK,
    HELLO,
    MAGIC,
    PROOF,
    PULL,
    REFUSED,
    RESULT,
    UNAUTHENTICATED,
)
from tests.actors.helpers import wait_until
from tests.transport.rpc_helpers import RawClient, frame, free_port, part_header

pytestmark = pytest.mark.anyio

SECRET = "correct horse battery staple"


async def echo(payload: Any, peer: Peer) -> Any:
    return payload


@pytest.mark.parametrize(
    "url", ["tcp://0.0.0.0:0", "tcp://:0", "tcp://example.com:0", "tcp://10.1.2.3:0", "tcp4://*:0"]
)
async def test_a_reachable_tcp_server_needs_a_secret(url: str) -> None:
    with pytest.raises(ValueError, match="without a secret"):
        await serve(url, echo)


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:0", "tcp://localhost:0", "tcp://127.0.0.2:0"])
async def test_loopback_needs_no_secret(url: str) -> None:
    server = await serve(url, echo)
    async with await connect(server.url) as client:
        assert await client.request("hi") == "hi"
    await server.aclose()


@pytest.mark.parametrize("scheme", ["tcp", "ipc", "inproc"])
async def test_matching_secrets_connect_and_others_are_refused(scheme: str, tmp_path: Any) -> None:
    url = {
        "tcp": "tcp://127.0.0.1:0",
        "ipc": f"ipc://{tmp_path}/s.sock",
        "inproc": f"inproc://{uuid.uuid4().hex}",
    }[scheme]
    async with await serve(url, echo, secret=SECRET) as server:
        async with await connect(server.url, secret=SECRET.encode()) as client:
            assert await client.request("in") == "in"
            if scheme != "inproc":
                assert client.statistics()["handshakes"] == 1
        with pytest.raises(AuthFailed):
            await connect(server.url, secret="wrong")
        with pytest.raises(AuthFailed, match=r"requires a shared secret|secrets differ"):
            await connect(server.url)
    # A client with a secret refuses a server that cannot prove it holds the same one.
    async with await serve(url, echo) as open_server:
        with pytest.raises(AuthFailed):
            await connect(open_server.url, secret=SECRET)


async def test_an_impostor_can_neither_get_requests_handled_nor_read_replies() -> None:
    calls: list[Any] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        calls.append(payload)
        return {"secret data": payload, "pad": bytes(50_000)}

    limits = Limits(frame_bytes=4096)
    async with await serve("tcp://127.0.0.1:0", handler, secret=SECRET, limits=limits) as server:
        async with await connect(server.url, secret=SECRET, limits=limits) as client:
            await client.request("legit")  # its reply stays cached until the next request
            session = client._session  # type: ignore[attr-defined]
            with structlog.testing.capture_logs() as logs:
                async with RawClient(server.url) as raw:
                    # A request without the handshake is refused.
                    head, _ = await raw.request(
                        frame(part_header(session, 1, "evil", ack_below=0), "evil")
                    )
                    assert head[:2] == [REFUSED, UNAUTHENTICATED]
                    # Pulling the legit client's cached reply is refused too: no data leaks.
                    head, data = await raw.request(frame([PULL, session, 0, 4096, 4096]))
                    assert head[:2] == [REFUSED, UNAUTHENTICATED] and data == b""
                    # A handshake with a guessed proof fails.
                    head, _ = await raw.request(frame([HELLO, os.urandom(NONCE_BYTES)]))
                    assert head[0] == CHALLENGE and head[1] is not None
                    head, _ = await raw.request(frame([PROOF, os.urandom(32)]))
                    assert head[:2] == [REFUSED, "auth"]
                    # And the connection is still not authenticated afterwards.
                    head, _ = await raw.request(
                        frame(part_header(session, 1, "evil", ack_below=0), "evil")
                    )
                    assert head[:2] == [REFUSED, UNAUTHENTICATED]
            assert await client.request("still fine") is not None
        stats = server.statistics()
    assert calls == ["legit", "still fine"]
    assert stats["auth_failures"] == 4
    refusals = [e for e in logs if e["log_level"] == "warning"]
    assert len(refusals) == 4 and all(e["peer"].startswith("tcp://127.0.0.1:") for e in refusals)
    assert head[0] not in (RESULT, CHUNK)


async def test_the_client_handshakes_again_after_a_reconnect() -> None:
    async with await serve("tcp://127.0.0.1:0", echo, secret=SECRET) as server:
        async with await connect(server.url, secret=SECRET) as client:
            assert await client.request(1) == 1
            for pipe in server._sock.pipes:  # type: ignore[attr-defined]  # drop the connection
                pipe.close()
            await wait_until(lambda: client.statistics()["reconnects"] == 1, what="reconnect")
            assert await client.request(2, timeout=10) == 2
            assert client.statistics()["handshakes"] == 2
        assert server.statistics()["auth_failures"] == 1  # the one refusal that triggered it


async def test_the_client_does_not_trust_a_new_server_that_skips_the_handshake() -> None:
    """An impostor at the address of a server that went away answers without asking for a
    handshake; the client still refuses its replies. (The secret authenticates, it does not
    encrypt: the impostor does see the requests that NNG resends to it.)"""

    async def impostor(payload: Any, peer: Peer) -> Any:
        return "forged"

    url = f"tcp://127.0.0.1:{free_port()}"
    real = await serve(url, echo, secret=SECRET)
    client = await connect(url, secret=SECRET, connect_timeout=10)
    try:
        assert await client.request("real") == "real"
        await real.aclose()
        async with await serve(url, impostor) as fake:  # on loopback: no secret needed
            with pytest.raises(AuthFailed):
                await client.request("x", timeout=10)
            assert fake.statistics()["requests"] >= 1  # it answered; the answer was dropped
    finally:
        await client.aclose()


async def test_garbage_does_not_kill_the_server() -> None:
    calls: list[Any] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        calls.append(payload)
        return payload

    junk = [
        b"",
        b"hello",
        os.urandom(1000),
        MAGIC + b"\xff\xff",  # header length past the end
        MAGIC + b"\x02\x00\xc1\xc1",  # msgpack that does not parse
        frame([99]),  # unknown kind
        frame([RESULT, True, 1]),  # a server's frame sent to the server
        frame(["3", "x"]),  # kind of the wrong type
        frame([3, 1, 2, 3, 4, 5, 6, 7, 8]),  # PART with fields of the wrong types
        frame([3, "x", b"short", 0, 0, [], 0, 10, 4096], raw=b"x" * 20),  # inconsistent sizes
    ]
    async with await serve("tcp://127.0.0.1:0", handler) as server:
        async with RawClient(server.url) as raw:
            for data in junk:
                head, _ = await raw.request(data)
                assert head[:2] == [REFUSED, BAD]
            head, _ = await raw.request(frame([PULL, b"s" * 16, 0, -5, 4096]))
            assert head[:2] == [REFUSED, "gone"]  # well-formed, about nothing: refused
        # A frame above recv_max_size is dropped by NNG itself; the server does not notice.
        async with RawClient(server.url, recv_timeout_ms=300) as raw:
            with contextlib.suppress(Exception):
                await raw.send_raw(os.urandom((1 << 20) + 8192))
        async with await connect(server.url) as client:
            assert await client.request("works") == "works"
            assert await asyncio.gather(*(client.request(i) for i in range(10))) == list(range(10))
        stats = server.statistics()
    assert stats["bad_frames"] == len(junk)
    assert calls[0] == "works" and sorted(calls[1:]) == list(range(10))
