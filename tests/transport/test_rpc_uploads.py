"""Chunked uploads take memory as their bytes arrive, and are capped per connection and in all.

Frames are hand-made on authenticated raw REQ sockets (tcp:// with a secret), as a peer that
holds the secret but not our client's manners would send them.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from relax.errors import TransportError
from relax.transport import Limits, Peer, connect, serve
from relax.transport._auth import client_proof, nonce, normalize_secret
from relax.transport._rpc_frames import ACK, BUSY, CHALLENGE, HELLO, PART, PROOF, REFUSED, WELCOME
from tests.actors.helpers import wait_until
from tests.transport.rpc_helpers import RawClient, frame

pytestmark = pytest.mark.anyio

SECRET = "a shared secret for the upload tests"


async def echo(payload: Any, peer: Peer) -> Any:
    return payload


async def authenticate(raw: RawClient) -> None:
    cnonce = nonce()
    head, _ = await raw.request(frame([HELLO, cnonce]))
    assert head[0] == CHALLENGE
    proof = client_proof(normalize_secret(SECRET), head[1], cnonce)
    head, _ = await raw.request(frame([PROOF, proof]))
    assert head == [WELCOME]


def part(session: bytes, rid: int, offset: int, total: int, data: bytes) -> bytes:
    return frame([PART, "raw", session, rid, 0, [], offset, total, 1 << 20], raw=data)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


async def test_announced_sizes_are_not_memory() -> None:
    """Four authenticated 1 KiB frames announcing 256 MiB uploads used to allocate (and zero)
    1 GiB in the server; now the server holds the 4 KiB that arrived."""
    announced = 256 << 20
    server = await serve("tcp://127.0.0.1:0", echo, secret=SECRET)
    async with server, RawClient(server.url) as raw:
        await authenticate(raw)
        session = os.urandom(16)
        before = rss_bytes()
        for rid in range(4):
            head, _ = await raw.request(part(session, rid, 0, announced, bytes(1024)))
            assert head == [ACK]
        grown = rss_bytes() - before
        stats = server.statistics()
    assert stats["partials"] == 4 and stats["partial_bytes"] == 4 * 1024
    assert grown < 64 << 20, f"the server's memory grew by {grown >> 20} MiB"


async def test_partial_uploads_are_capped_per_connection_and_in_all() -> None:
    limits = Limits(
        frame_bytes=4096, max_message_bytes=1 << 20, max_partials_per_connection=2, max_partials=3
    )
    total = 64 << 10
    async with await serve("tcp://127.0.0.1:0", echo, secret=SECRET, limits=limits) as server:
        async with RawClient(server.url) as a, RawClient(server.url) as b:
            await authenticate(a)
            await authenticate(b)
            sa, sb = os.urandom(16), os.urandom(16)
            for rid in (0, 1):
                assert (await a.request(part(sa, rid, 0, total, bytes(4096))))[0] == [ACK]
            head, _ = await a.request(part(sa, 2, 0, total, bytes(4096)))
            assert head[:2] == [REFUSED, BUSY] and "max_partials_per_connection=2" in head[2]
            # A part of an upload already under way is still taken.
            assert (await a.request(part(sa, 1, 4096, total, bytes(4096))))[0] == [ACK]
            assert (await b.request(part(sb, 0, 0, total, bytes(4096))))[0] == [ACK]
            head, _ = await b.request(part(sb, 1, 0, total, bytes(4096)))
            assert head[:2] == [REFUSED, BUSY] and "max_partials=3" in head[2]
            # Our own client meets the same cap with a clear error, not a hang.
            async with await connect(server.url, secret=SECRET, limits=limits) as client:
                with pytest.raises(TransportError, match=r"busy.*max_partials=3"):
                    await client.request(bytes(20_000))
                stats = server.statistics()
                assert stats["partials"] == 3 and stats["partials_refused"] == 3
                assert stats["partial_bytes"] == 4 * 4096
        # The raw connections are gone: their uploads are dropped, and uploads work again.
        await wait_until(lambda: server.statistics()["partials"] == 0, what="partials dropped")
        async with await connect(server.url, secret=SECRET, limits=limits) as client:
            assert await client.request(bytes(20_000)) == bytes(20_000)
        assert server.statistics()["partial_bytes"] == 0


async def test_bytes_held_in_partial_uploads_are_capped() -> None:
    limits = Limits(frame_bytes=4096, max_message_bytes=24 << 10, max_partial_bytes=30 << 10)
    total = 24 << 10
    server = await serve("tcp://127.0.0.1:0", echo, secret=SECRET, limits=limits)
    async with server, RawClient(server.url) as raw:
        await authenticate(raw)
        session = os.urandom(16)
        for offset in range(0, 20 << 10, 4096):  # 20 KiB of upload 0 in
            assert (await raw.request(part(session, 0, offset, total, bytes(4096))))[0] == [ACK]
        assert (await raw.request(part(session, 1, 0, total, bytes(4096))))[0] == [ACK]
        assert (await raw.request(part(session, 1, 4096, total, bytes(4096))))[0] == [ACK]
        # 28 KiB held; 4 KiB more would pass 30 KiB: refused, and that upload dropped.
        head, _ = await raw.request(part(session, 1, 8192, total, bytes(4096)))
        assert head[:2] == [REFUSED, BUSY] and "max_partial_bytes=30720" in head[2]
        stats = server.statistics()
        assert stats["partials"] == 1 and stats["partial_bytes"] == 20 << 10
        # Upload 0 completes: its request is handled and its bytes are released.
        head, _ = await raw.request(part(session, 0, 20 << 10, total, bytes(4096)))
        assert head[0] != REFUSED
        assert server.statistics()["partial_bytes"] == 0
