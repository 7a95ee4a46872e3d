"""Helpers for the RPC tests: hand-made frames and a raw pynng REQ peer (not our client)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import msgpack
import pynng

from relax.transport._rpc_frames import _PREFIX, MAGIC, PART, encode, parse

REPO = Path(__file__).resolve().parents[2]


def frame(header: list[Any], payload: Any = None, *, raw: bytes | None = None) -> bytes:
    """A frame as bytes: ``header`` plus ``raw`` bytes or ``payload`` in the wire format."""
    head = msgpack.packb(header, use_bin_type=True)
    if raw is None:
        parts, _ = encode(payload)
        raw = b"".join(bytes(p) for p in parts) if payload is not None or header[0] == PART else b""
    return _PREFIX.pack(MAGIC, len(head)) + head + raw


def part_header(session: bytes, rid: int, payload: Any, *, ack_below: int) -> list[Any]:
    """The header of a one-frame request carrying ``payload``."""
    _, size = encode(payload)
    return [PART, "raw", session, rid, ack_below, [], 0, size, 1 << 20]


class RawClient:
    """A plain pynng REQ socket speaking bytes: for junk, duplicates and impostors."""

    def __init__(self, url: str, recv_timeout_ms: int = 10_000) -> None:
        self.sock = pynng.Req0(recv_timeout=recv_timeout_ms, recv_max_size=0)
        self.sock.dial(url, block=True)

    async def send_raw(self, data: bytes) -> bytes:
        await self.sock.asend(data)
        return await self.sock.arecv()

    async def request(self, data: bytes) -> tuple[list[Any], bytes]:
        """Send one frame, return the reply frame's header and data."""
        reply = await self.send_raw(data)
        header, body = parse(memoryview(reply))
        return header, bytes(body)

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PeerProcess:
    """``python -m tests.transport.rpc_peer ...`` as a child we can SIGKILL."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "RELAX_LOG_LEVEL": "warning"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transport.rpc_peer", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def exited(self) -> bool:
        return self.proc.poll() is not None
