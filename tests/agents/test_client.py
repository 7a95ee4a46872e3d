"""``Policy``, the asyncio client of the agent endpoint: calls, sessions, errors, cancellation."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from relax.agents._client import AgentEndpointError, ChatReply, Completion, Policy
from relax.agents._server import AgentServer
from relax.agents._trajectory import model_spans
from relax.errors import PeerGone, RelaxError
from tests.actors.helpers import wait_until
from tests.agents.test_server import (
    KEY,
    USER,
    Finished,
    ScriptedEngine,
    finished,
    hf_engine,
    policy,
    recompute,
    serve,
    server,
)

pytestmark = pytest.mark.anyio

__all__ = ["finished", "policy", "server"]  # fixtures shared with the server tests


@pytest.fixture
async def client(server: AgentServer) -> AsyncIterator[Policy]:
    async with Policy(server.url, KEY) as client:
        yield client


async def test_generate(client: Policy, policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    assert await client.version() == 0
    [out] = await client.generate("Hello", max_tokens=6, seed=4)
    assert isinstance(out, Completion)
    assert out.prompt_token_ids == tokenizer.encode("Hello")
    assert 1 <= len(out.token_ids) == len(out.logprobs) <= 6
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason in ("stop", "length") and out.version == 0
    assert out.logprobs == pytest.approx(
        recompute(model, out.prompt_token_ids, out.token_ids, 1.0), abs=1e-4
    )
    # Token ids in, same seed: the same sample.
    [same] = await client.generate(tokenizer.encode("Hello"), max_tokens=6, seed=4)
    assert same.token_ids == out.token_ids
    many = await client.generate("Hello", max_tokens=3, n=3, seed=1, temperature=0.8)
    assert len(many) == 3 and len({tuple(c.token_ids) for c in many}) == 3
    greedy = await client.generate("Hello", max_tokens=8, temperature=0, stop="\x7f")
    assert (
        greedy[0].token_ids
        == (await client.generate("Hello", max_tokens=8, temperature=0))[0].token_ids
    )


async def test_chat_session_and_finish(
    client: Policy, server: AgentServer, finished: Finished
) -> None:
    messages: list[dict[str, Any]] = list(USER)
    [first] = await client.chat(messages, max_tokens=5, seed=1, session="ep-1")
    assert isinstance(first, ChatReply) and first.message["role"] == "assistant"
    assert len(first.token_ids) == len(first.logprobs) and first.version == 0
    messages += [first.message, {"role": "user", "content": "more"}]
    [second] = await client.chat(messages, max_tokens=5, seed=2, session="ep-1")
    summary = await client.finish("ep-1", 1.0, attempt=3)
    assert summary["session"] == "ep-1" and summary["turns"] == 2 and summary["version"] == 0
    [(session, trajectory, body)] = finished.calls
    assert session == "ep-1" and body["attempt"] == 3 and trajectory.reward == 1.0
    assert model_spans(trajectory.loss_mask, trajectory.response_ids) == [
        first.token_ids,
        second.token_ids,
    ]
    assert server.statistics()["requests"]["finish"] == 1
    # A session id with characters that need quoting travels intact.
    await client.chat(USER, max_tokens=2, session="run 7/ep 2")
    assert (await client.finish("run 7/ep 2", 0.0))["session"] == "run 7/ep 2"
    assert client.session_url("a b") == f"{server.url}/sessions/a%20b/v1"


async def test_errors_are_mapped(server: AgentServer, client: Policy) -> None:
    with pytest.raises(AgentEndpointError) as info:
        await client.generate("Hello", n=0)
    error = info.value
    assert isinstance(error, RelaxError)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", "n")
    assert "n" in error.message
    with pytest.raises(AgentEndpointError) as info:
        await client.finish("nobody", 1.0)
    assert info.value.status == 404 and info.value.code == "session_not_found"
    async with Policy(server.url, "wrong") as wrong:
        with pytest.raises(AgentEndpointError) as info:
            await wrong.version()
    assert info.value.status == 401 and info.value.type == "authentication_error"


async def test_an_endpoint_that_is_not_running_is_peer_gone() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with Policy(f"http://127.0.0.1:{port}", KEY) as client:
        with pytest.raises(PeerGone, match="unreachable"):
            await client.version()


async def test_without_async_with(server: AgentServer) -> None:
    client = Policy(server.url + "/", KEY)  # a trailing slash is fine
    try:
        assert await client.version() == 0
    finally:
        await client.aclose()
    assert client._http is None


async def test_cancelling_a_call_leaks_nothing(policy: tuple[Any, Any]) -> None:
    tokenizer = policy[1]
    engine = ScriptedEngine(tokenizer, ["first", "abandoned", "retried"])
    engine.gate = asyncio.Event()  # the engine "generates" until the gate opens
    async with serve(engine, tokenizer, on_finish=Finished()) as server:
        async with Policy(server.url, KEY) as client:
            [first] = await _released(engine, client.chat(USER, session="s"))
            messages = [*USER, first.message, {"role": "user", "content": "again"}]
            engine.gate.clear()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.chat(messages, session="s"), 0.2)
            # The server saw the disconnect and dropped the request.
            await wait_until(lambda: server.statistics()["cancelled"] == 1, what="cancel")
            assert server.statistics()["sampler"]["cancelled"] == 1
            http = client._http
            assert http is not None and not http.closed
            assert await client.version() == 0  # the client and the server still work
            engine.gate.set()
            # Retrying the abandoned call continues the session (no new segment).
            [retried] = await client.chat(messages, session="s")
            assert retried.message["content"] == "retried"
            assert (await client.finish("s", 1.0))["turns"] == 2
            assert server.statistics()["sessions"]["segments_dropped"] == 0
            connector = http.connector
            assert connector is not None
        assert http.closed and connector.closed  # everything closed on exit


async def test_cancelling_a_long_real_generation(policy: tuple[Any, Any]) -> None:
    async with (
        serve(hf_engine(policy), policy[1], stop_token_ids=[]) as server,  # no early stop
        Policy(server.url, KEY) as client,
    ):
        with pytest.raises(asyncio.TimeoutError):
            # 8 x 500 tokens: a few hundred ms of decoding, abandoned after 50.
            long = client.generate("Hello", max_tokens=500, n=8, seed=0)
            await asyncio.wait_for(long, 0.05)
        await wait_until(lambda: server.statistics()["cancelled"] == 1, what="cancel")
        assert await client.version() == 0
        [out] = await client.generate("Hello", max_tokens=3, seed=0)
        assert len(out.token_ids) <= 3
        http = client._http
    assert http is not None and http.closed


async def _released(engine: ScriptedEngine, call: Any) -> Any:
    assert engine.gate is not None
    engine.gate.set()
    return await call
