"""RPC with peers that die for real (SIGKILL) and come back on the same URL."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relax.errors import PeerGone
from relax.transport import Limits, Peer, connect, serve
from tests.actors.helpers import wait_until
from tests.transport.rpc_helpers import PeerProcess, free_port

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SECRET = "s3cret"
FRAME = 64 * 1024


@contextlib.contextmanager
def peer(*args: str) -> Iterator[PeerProcess]:
    proc = PeerProcess(*args)
    try:
        yield proc
    finally:
        proc.kill()


async def started(proc: PeerProcess) -> str:
    line = await asyncio.to_thread(proc.readline)
    assert line.startswith("ready "), f"peer did not start: {line!r}"
    return line.split(" ", 1)[1]


@contextlib.asynccontextmanager
async def serving(*args: str) -> AsyncIterator[PeerProcess]:
    with peer("serve", *args) as proc:
        await started(proc)
        yield proc


def handled(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


async def test_a_dead_server_fails_pending_and_new_requests_with_peer_gone(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "handled.log"
    async with serving(url, "--log", str(log)) as proc:
        client = await connect(url, connect_timeout=0.5)
        try:
            pending = asyncio.create_task(client.request({"op": "block", "tag": "p"}))
            bounded = asyncio.create_task(client.request({"op": "block", "tag": "b"}, timeout=1.0))
            await wait_until(lambda: len(handled(log)) == 2, what="both handlers running")
            proc.kill()
            start = time.monotonic()
            with pytest.raises(PeerGone):
                await pending  # no timeout: connect_timeout after the connection went down
            with pytest.raises(PeerGone):
                await bounded  # its own timeout passed while the server was away
            with pytest.raises(PeerGone):
                await client.request({"op": "echo", "x": 1}, timeout=0.3)
            with pytest.raises(PeerGone):
                await client.request({"op": "echo", "x": 1})
            assert time.monotonic() - start < 5
            assert client.statistics()["peer_gone"] == 4
        finally:
            await client.aclose()


@pytest.mark.parametrize("secret", [None, SECRET])
async def test_requests_complete_on_a_server_restarted_at_the_same_url(
    tmp_path: Path, secret: str | None
) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    log, gate = tmp_path / "handled.log", tmp_path / "gate"
    extra = ["--log", str(log)] + (["--secret", secret] if secret else [])
    async with serving(url, *extra) as first:
        client = await connect(url, secret=secret, connect_timeout=20)
        try:
            pending = asyncio.create_task(
                client.request({"op": "wait_file", "path": str(gate), "tag": "slow"}, timeout=30)
            )
            await wait_until(lambda: handled(log) == ["wait_file slow"], what="handler running")
            first.kill()
            await wait_until(lambda: not client.statistics()["connected"], what="disconnect")
            fresh = asyncio.create_task(client.request({"op": "pid", "tag": "new"}, timeout=30))
            gate.touch()  # the first server would have answered now; it is dead
            async with serving(url, *extra) as second:
                assert await fresh == second.pid
                assert await pending == second.pid  # resent to the new server, answered there
        finally:
            await client.aclose()
    assert sorted(handled(log)) == ["pid new", "wait_file slow", "wait_file slow"]
    if secret:
        assert client.statistics()["handshakes"] == 2


async def test_a_server_killed_mid_upload_never_sees_half_a_message(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "handled.log"
    frame = ["--frame-bytes", str(FRAME), "--log", str(log)]
    t = torch.randint(0, 200, (1_000_000,), dtype=torch.uint8)  # 16 frames
    expected = {"sum": int(t.to(torch.int64).sum()), "n": t.numel()}
    async with serving(url, *frame, "--die-after-parts", "6") as first:
        client = await connect(url, limits=Limits(frame_bytes=FRAME), connect_timeout=20)
        try:
            upload = asyncio.create_task(client.request({"op": "sum", "t": t}, timeout=60))
            await wait_until(first.exited, what="the server to die mid-upload")
            async with serving(url, *frame):
                assert await upload == expected  # sent again, whole, to the new server
            assert client.statistics()["restarts"] >= 1
        finally:
            await client.aclose()
    assert handled(log) == ["sum "]  # the dead server never ran the handler


async def test_a_server_killed_mid_download_is_asked_again(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "handled.log"
    frame = ["--frame-bytes", str(FRAME), "--log", str(log)]
    async with serving(url, *frame, "--die-after-pulls", "3") as first:
        client = await connect(url, limits=Limits(frame_bytes=FRAME), connect_timeout=20)
        try:
            download = asyncio.create_task(client.request({"op": "big", "n": 500_000}, timeout=60))
            await wait_until(first.exited, what="the server to die mid-download")
            async with serving(url, *frame):
                assert torch.equal(await download, torch.arange(500_000, dtype=torch.int32))
        finally:
            await client.aclose()
    assert handled(log) == ["big ", "big "]  # once per server life, never twice on one


async def test_a_client_killed_mid_upload_leaves_nothing_behind() -> None:
    calls: list[Any] = []

    async def handler(payload: Any, peer: Peer) -> Any:
        calls.append(payload)
        return "handled"

    async with await serve(
        "tcp://127.0.0.1:0", handler, limits=Limits(frame_bytes=FRAME)
    ) as server:
        args = ("upload", server.url, "1000000", "--frame-bytes", str(FRAME))
        with peer(*args, "--die-after-parts", "5") as proc:
            await wait_until(proc.exited, what="the client to die mid-upload")
        await wait_until(lambda: server.statistics()["partials_dropped"] == 1, what="drop")
        assert server.statistics()["partials"] == 0
        assert server.statistics()["frames_in"] >= 5
    assert calls == []
