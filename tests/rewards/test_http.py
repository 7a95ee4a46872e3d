"""The http verifier against a tiny real HTTP server on 127.0.0.1 (asyncio.start_server)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from relax.config import RewardConfig
from relax.rewards import RewardSet

pytestmark = pytest.mark.anyio


def _reply(status: int, body: bytes, *, chunked: bool = False) -> bytes:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
    if chunked:
        half = len(body) // 2
        chunks = b"".join(
            f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:half], body[half:])
        )
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + chunks + b"0\r\n\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class RewardServer:
    """Routes by path: /ok scores len(response) * sample["scale"]; the rest misbehave."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], Any]] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode()
            path = request_line.split()[1]
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            payload = json.loads(await reader.readexactly(int(headers["content-length"])))
            self.requests.append((headers, payload))
            if path == "/ok":
                score = len(payload["response"]) * payload["sample"]["scale"]
                writer.write(_reply(200, json.dumps({"reward": score}).encode()))
            elif path == "/chunked":
                writer.write(_reply(200, b'{"reward": 0.75}', chunked=True))
            elif path == "/close":  # no length: the body ends when the connection does
                writer.write(b'HTTP/1.1 200 OK\r\n\r\n{"reward": -1}')
            elif path == "/500":
                writer.write(_reply(500, b"internal explosion"))
            elif path == "/badjson":
                writer.write(_reply(200, b"<html>not json</html>"))
            elif path == "/noreward":
                writer.write(_reply(200, b'{"score": 1}'))
            elif path == "/nan":
                writer.write(_reply(200, b'{"reward": NaN}'))
            elif path == "/slow":
                await asyncio.sleep(5)
            await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[RewardServer]:
    state = RewardServer()
    srv = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield state
        srv.close()


def http(port: int, path: str, **fields: Any) -> RewardSet:
    function = {"name": "judge", "kind": "http", "target": f"http://127.0.0.1:{port}{path}"}
    return RewardSet.from_config(RewardConfig(functions=[{**function, **fields}]))


async def test_success(server: RewardServer) -> None:
    rewards = http(server.port, "/ok", options={"headers": {"Authorization": "Bearer t"}})
    result = await rewards.score("abcd", {"scale": 0.5, "answer": "x"}, response_tokens=3)
    assert result.ok and result.reward == 2.0 and result.components == {"judge": 2.0}
    headers, payload = server.requests[0]
    assert headers["authorization"] == "Bearer t"
    assert payload == {
        "response": "abcd",
        # The whole sample: its row's fields and the standard keys (relax.rewards.Sample).
        "sample": {
            "scale": 0.5,
            "answer": "x",
            "response": "abcd",
            "response_ids": [],
            "response_tokens": 3,
            "prompt": "",
            "messages": None,
            "prompt_ids": [],
            "uid": "",
            "group": "",
        },
        "response_tokens": 3,
    }


async def test_chunked_and_close_delimited_replies(server: RewardServer) -> None:
    assert (await http(server.port, "/chunked").score("x", {})).reward == 0.75
    assert (await http(server.port, "/close").score("x", {})).reward == -1.0


async def test_many_concurrent_requests(server: RewardServer) -> None:
    rewards = http(server.port, "/ok", options={"max_concurrency": 4})
    results = await asyncio.gather(*(rewards.score("x" * i, {"scale": 1}) for i in range(20)))
    assert [r.reward for r in results] == [float(i) for i in range(20)]


@pytest.mark.parametrize(
    ("path", "kind", "reason"),
    [
        ("/500", "error", "http 'judge': raised HttpError: HTTP 500: internal explosion"),
        ("/badjson", "error", "reply is not JSON"),
        ("/noreward", "error", 'reply has no "reward"'),
        ("/nan", "invalid", "http 'judge': returned nan"),
    ],
)
async def test_bad_replies_fail_the_sample(
    server: RewardServer, path: str, kind: str, reason: str
) -> None:
    rewards = http(server.port, path)
    result = await rewards.score("x", {})
    assert not result.ok and result.reward is None
    assert reason in (result.reason or "")
    assert result.failures == {"judge": kind}
    assert rewards.statistics()["functions"]["judge"]["failures"] == {kind: 1}


async def test_slow_endpoint_times_out(server: RewardServer) -> None:
    rewards = http(server.port, "/slow", timeout=0.2)
    start = time.perf_counter()
    result = await rewards.score("x", {})
    assert time.perf_counter() - start < 0.6
    assert result.reason == "http 'judge': timed out after 0.2s"


async def test_connection_refused_fails_the_sample() -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = await http(port, "/ok", timeout=2.0).score("x", {})
    assert not result.ok and result.failures == {"judge": "error"}
    assert "ConnectionRefusedError" in (result.reason or "") or "OSError" in (result.reason or "")


async def test_sample_keys_and_unserialisable_samples(server: RewardServer) -> None:
    sample = {"scale": 2, "blob": object()}
    result = await http(server.port, "/ok").score("ab", sample)
    assert not result.ok and "not JSON serializable" in (result.reason or "")
    narrowed = http(server.port, "/ok", options={"sample_keys": ["scale"]})
    assert (await narrowed.score("ab", sample)).reward == 4.0
    assert server.requests[-1][1]["sample"] == {"scale": 2}
