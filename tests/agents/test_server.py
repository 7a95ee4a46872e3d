"""The OpenAI-compatible agent endpoint, driven by the unmodified ``openai`` client.

A real tiny model behind a real ``HFEngine`` → ``Sampler`` → ``SessionStore`` → ``AgentServer``
on 127.0.0.1; where a test needs the model to write something specific (a tool call) a scripted
engine stands in for ``HFEngine`` and everything else stays real.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch

from relax.agents._chat import continuation_ids, prompt_ids
from relax.agents._sampler import Sampler
from relax.agents._server import AgentServer
from relax.agents._sessions import SessionStore
from relax.agents._trajectory import Trajectory, model_spans
from relax.config import ModelInitConfig
from relax.engines import Generation, GenerationEngine, HFEngine, SamplingParams
from relax.models import build_tiny_model, load_policy
from relax.models._tokenizers import IM_END, pad_token_id, stop_token_ids

pytestmark = pytest.mark.anyio

KEY = "sk-test-key"
MAX_LEN = 512
TINY = ModelInitConfig(
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    vocab_size=261,  # exactly the byte tokenizer: every sampled id decodes to something
    max_position_embeddings=MAX_LEN,
)
USER = [{"role": "user", "content": "Hello there"}]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The tiny model and its byte tokenizer, loaded the way a real checkpoint is."""
    folder: Path = build_tiny_model(TINY, tmp_path_factory.mktemp("agent-policy"))
    return load_policy(folder)


def hf_engine(policy: tuple[Any, Any]) -> HFEngine:
    model, tokenizer = policy
    return HFEngine(model, pad_token_id=pad_token_id(tokenizer), tokenizer=tokenizer)


class ScriptedEngine(GenerationEngine):
    """Answers every prompt with the next scripted reply text (then ``<|im_end|>``).

    ``gate``: when set, each ``generate`` first waits for it (a reply that takes a while);
    ``fail``: the engine breaks (raises) instead.
    """

    def __init__(self, tokenizer: Any, replies: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.gate: asyncio.Event | None = None
        self.fail = False
        self.calls = 0

    @property
    def version(self) -> int:
        return 0

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("the accelerator caught fire")
        out = []
        end = self.tokenizer.convert_tokens_to_ids(IM_END)
        for prompt in prompts:
            self.prompts.append(list(prompt))
            for index in range(params.n):
                ids = [*self.tokenizer.encode(self.replies.pop(0)), end][: params.max_new_tokens]
                stop = ids[-1] in params.stop_token_ids
                out.append(
                    Generation(
                        prompt_ids=list(prompt),
                        response_ids=ids,
                        logprobs=[-0.5] * len(ids),
                        finish_reason="stop" if stop else "length",
                        version=0,
                        index=index,
                    )
                )
        return out

    async def load_weights(self, version: int, state_dict: Any) -> None:
        raise NotImplementedError

    def statistics(self) -> dict[str, float | int]:
        return {"calls": self.calls}


@contextlib.asynccontextmanager
async def serve(
    engine: GenerationEngine, tokenizer: Any, **kwargs: Any
) -> AsyncIterator[AgentServer]:
    """A started endpoint over ``engine`` (API key ``KEY``), closed with its sampler."""
    sampler = Sampler(engine)
    options: dict[str, Any] = {
        "api_key": KEY,
        "max_model_len": MAX_LEN,
        "stop_token_ids": stop_token_ids(tokenizer),
        **kwargs,
    }
    try:
        async with AgentServer(
            sampler=sampler, tokenizer=tokenizer, sessions=SessionStore(tokenizer), **options
        ) as server:
            yield server
    finally:
        await sampler.aclose()


def openai_client(base_url: str, api_key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)


class Finished:
    """An ``on_finish`` that keeps what it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Trajectory, dict[str, Any]]] = []

    async def __call__(self, session: str, trajectory: Trajectory, body: dict[str, Any]) -> None:
        self.calls.append((session, trajectory, body))


@pytest.fixture
def finished() -> Finished:
    return Finished()


@pytest.fixture
async def server(policy: tuple[Any, Any], finished: Finished) -> AsyncIterator[AgentServer]:
    async with serve(hf_engine(policy), policy[1], on_finish=finished) as server:
        yield server


@pytest.fixture
async def client(server: AgentServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(f"{server.url}/v1") as client:
        yield client


async def raw(
    method: str, url: str, *, key: str | None = KEY, **kwargs: Any
) -> tuple[int, dict[str, Any]]:
    """One plain HTTP request: status and JSON body."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url, headers=headers, **kwargs) as response,
    ):
        return response.status, await response.json(content_type=None)


async def finish(server: AgentServer, session: str, **body: Any) -> tuple[int, dict[str, Any]]:
    return await raw("POST", f"{server.url}/relax/v1/sessions/{session}/finish", json=body)


def recompute(model: Any, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each id, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()


def extra(obj: Any, name: str) -> Any:
    """An extension field the openai client kept (``model_extra``)."""
    return (obj.model_extra or {})[name]


# --------------------------------------------------------------------------- basics


async def test_models_version_and_url(server: AgentServer, client: openai.AsyncOpenAI) -> None:
    assert server.url.startswith("http://127.0.0.1:")
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    assert (await client.models.retrieve("policy")).id == "policy"
    assert await raw("GET", f"{server.url}/relax/v1/version") == (200, {"version": 0})


async def test_chat_completion(
    server: AgentServer, client: openai.AsyncOpenAI, policy: tuple[Any, Any]
) -> None:
    tokenizer = policy[1]
    reply = await client.chat.completions.create(
        model="policy", messages=USER, max_tokens=8, seed=3
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "policy"
    [choice] = reply.choices
    ids = extra(choice, "token_ids")
    assert 1 <= len(ids) <= 8
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if ids[-1] in stop_token_ids(tokenizer) else "length")
    assert extra(choice, "token_versions") == [0] * len(ids)
    prompt = extra(reply, "prompt_token_ids")
    assert prompt == prompt_ids(tokenizer, USER)
    assert extra(reply, "relax") == {"version": 0, "session": None}
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(ids))
    assert reply.usage.total_tokens == len(prompt) + len(ids)
    # Same seed, same reply; no session: nothing recorded.
    again = await client.chat.completions.create(
        model="policy", messages=USER, max_tokens=8, seed=3
    )
    assert extra(again.choices[0], "token_ids") == ids
    assert server.statistics()["sessions"]["open"] == 0


async def test_streaming_matches_the_whole_reply(client: openai.AsyncOpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "policy", "messages": USER, "max_tokens": 12, "seed": 5}
    whole = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason
    assert extra(deltas[-1], "token_ids") == extra(whole.choices[0], "token_ids")
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # With logprobs, each piece carries its tokens' logprobs.
    scored = await client.chat.completions.create(**kwargs, logprobs=True)
    stream = await client.chat.completions.create(**kwargs, logprobs=True, stream=True)
    pieces = [c.choices[0].logprobs async for c in stream]
    streamed = [t.logprob for p in pieces if p is not None for t in p.content or []]
    assert scored.choices[0].logprobs is not None
    assert streamed == [t.logprob for t in scored.choices[0].logprobs.content or []]
    assert len(streamed) == len(extra(whole.choices[0], "token_ids"))


async def test_completions_with_text_and_token_ids(
    client: openai.AsyncOpenAI, policy: tuple[Any, Any]
) -> None:
    tokenizer = policy[1]
    prompt = tokenizer.encode("Hello")
    kwargs: dict[str, Any] = {"model": "policy", "max_tokens": 6, "seed": 1}
    by_text = await client.completions.create(prompt="Hello", **kwargs)
    by_ids = await client.completions.create(prompt=prompt, **kwargs)
    one_in_a_list = await client.completions.create(prompt=["Hello"], **kwargs)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    for reply in (by_text, by_ids, one_in_a_list):
        assert extra(reply, "prompt_token_ids") == prompt
        assert reply.choices[0].text == by_text.choices[0].text
        assert extra(reply.choices[0], "token_ids") == extra(by_text.choices[0], "token_ids")
    ids = extra(by_text.choices[0], "token_ids")
    assert by_text.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    stream = await client.completions.create(prompt="Hello", stream=True, **kwargs)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == by_text.choices[0].text
    assert chunks[-1].choices[0].finish_reason == by_text.choices[0].finish_reason


async def test_n_choices(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="policy", messages=USER, max_tokens=6, n=3, seed=7
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    ids = [extra(c, "token_ids") for c in reply.choices]
    assert len({tuple(x) for x in ids}) == 3  # independent samples
    assert reply.usage is not None and reply.usage.completion_tokens == sum(map(len, ids))
    completions = await client.completions.create(
        model="policy", prompt="abc", max_tokens=4, n=2, seed=7
    )
    assert len(completions.choices) == 2


async def test_stop_strings(client: openai.AsyncOpenAI, policy: tuple[Any, Any]) -> None:
    tokenizer = policy[1]
    kwargs: dict[str, Any] = {"model": "policy", "prompt": "Hello", "temperature": 0}
    free = await client.completions.create(max_tokens=16, **kwargs)
    ids = extra(free.choices[0], "token_ids")
    # A stop string the greedy reply writes: two printable ASCII tokens not seen before them.
    printable = [j for j in range(1, len(ids)) if 32 <= ids[j] < 127]
    j = next(
        (
            j
            for j in printable
            if j + 1 in printable and chr(ids[j]) not in free.choices[0].text[:j]
        ),
        printable[-1],
    )
    stop = tokenizer.decode(ids[j : j + 2]) if j + 1 in printable else chr(ids[j])
    assert stop in free.choices[0].text
    first = tokenizer.decode(ids[:j])
    assert stop not in first  # the first occurrence starts at token j
    cut = await client.completions.create(max_tokens=16, stop=[stop, "\x7f\x7f\x7f"], **kwargs)
    choice = cut.choices[0]
    assert choice.text == first  # the stop string itself is not returned
    assert extra(choice, "token_ids") == ids[: j + len(stop)]  # ...but its tokens are kept
    assert choice.finish_reason == "stop"
    chat = await client.chat.completions.create(
        model="policy", messages=USER, temperature=0, max_tokens=16
    )
    text = chat.choices[0].message.content
    assert text
    stopped = await client.chat.completions.create(
        model="policy", messages=USER, temperature=0, max_tokens=16, stop=text[-1]
    )
    assert stopped.choices[0].message.content == text[: text.index(text[-1])]
    assert stopped.choices[0].finish_reason == "stop"
    # Streamed, the stop string never goes out, not even its first half.
    stream = await client.completions.create(
        max_tokens=16, stop=[stop, "\x7f\x7f\x7f"], stream=True, **kwargs
    )
    pieces = [c.choices[0] async for c in stream]
    assert "".join(p.text for p in pieces) == first
    assert pieces[-1].finish_reason == "stop"
    assert extra(pieces[-1], "token_ids") == ids[: j + len(stop)]
    stream = await client.chat.completions.create(
        model="policy", messages=USER, temperature=0, max_tokens=16, stop=text[-1], stream=True
    )
    deltas = [c.choices[0] async for c in stream]
    assert "".join(d.delta.content or "" for d in deltas) == text[: text.index(text[-1])]


async def test_max_tokens_ends_with_length(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="policy", messages=USER, max_tokens=3, n=4, seed=0
    )
    reasons = [c.finish_reason for c in reply.choices]
    assert "length" in reasons
    for choice in reply.choices:
        if choice.finish_reason == "length":
            assert len(extra(choice, "token_ids")) == 3
    # max_completion_tokens is the newer name of max_tokens.
    newer = await client.chat.completions.create(
        model="policy", messages=USER, max_completion_tokens=2, seed=0
    )
    assert len(extra(newer.choices[0], "token_ids")) <= 2


def distributions(model: Any, prompt: list[int], ids: list[int], temperature: float) -> Any:
    """log_softmax(logits / T) at each position of ``ids``, [len(ids), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1)


async def test_logprobs_are_the_sampling_policys(
    client: openai.AsyncOpenAI, policy: tuple[Any, Any]
) -> None:
    model, tokenizer = policy
    reply = await client.chat.completions.create(
        model="policy", messages=USER, max_tokens=8, temperature=0.7, logprobs=True, seed=2
    )
    choice = reply.choices[0]
    ids = extra(choice, "token_ids")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    values = [c.logprob for c in choice.logprobs.content]
    expected = recompute(model, extra(reply, "prompt_token_ids"), ids, 0.7)
    assert values == pytest.approx(expected, abs=1e-4)
    assert [c.token for c in choice.logprobs.content] == [tokenizer.decode([t]) for t in ids]
    assert all(c.top_logprobs == [] for c in choice.logprobs.content)  # none asked for

    completion = await client.completions.create(
        model="policy", prompt="Hello", max_tokens=6, logprobs=0, seed=2
    )
    [choice] = completion.choices
    ids = extra(choice, "token_ids")
    assert choice.logprobs is not None
    expected = recompute(model, tokenizer.encode("Hello"), ids, 1.0)
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.top_logprobs is None
    assert len(choice.logprobs.text_offset or []) == len(ids)


async def test_top_logprobs_are_the_top_of_the_sampled_distribution(
    client: openai.AsyncOpenAI, policy: tuple[Any, Any]
) -> None:
    model, tokenizer = policy
    ask: dict[str, Any] = {
        "model": "policy",
        "messages": USER,
        "max_tokens": 8,
        "temperature": 0.7,
        "logprobs": True,
        "top_logprobs": 4,
        "seed": 2,
    }
    reply = await client.chat.completions.create(**ask)
    [choice] = reply.choices
    ids = extra(choice, "token_ids")
    logp = distributions(model, extra(reply, "prompt_token_ids"), ids, 0.7)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    for t, entry in enumerate(choice.logprobs.content):
        values, top_ids = logp[t].topk(4)
        assert [c.logprob for c in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert [c.token for c in entry.top_logprobs] == [tokenizer.decode([i]) for i in top_ids]
        assert entry.logprob == pytest.approx(float(logp[t, ids[t]]), abs=1e-4)

    completion = await client.completions.create(
        model="policy", prompt="Hello", max_tokens=6, logprobs=3, seed=2
    )
    [choice] = completion.choices
    ids = extra(choice, "token_ids")
    logp = distributions(model, tokenizer.encode("Hello"), ids, 1.0)
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    for t, got in enumerate(choice.logprobs.top_logprobs):
        values, top_ids = logp[t].topk(3)
        want: dict[str, float] = {}
        for i, v in zip(top_ids.tolist(), values.tolist(), strict=True):
            want.setdefault(tokenizer.decode([i]), v)
        # OpenAI's shape: the top 3 and, always, the sampled token.
        want.setdefault(tokenizer.decode([ids[t]]), float(logp[t, ids[t]]))
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)

    # Streamed, the same numbers arrive piece by piece.
    stream = await client.chat.completions.create(**ask, stream=True)
    pieces = [c.choices[0].logprobs async for c in stream if c.choices]
    streamed = [t for p in pieces if p is not None for t in p.content or []]
    assert [[x.logprob for x in t.top_logprobs] for t in streamed] == [
        [x.logprob for x in t.top_logprobs] for t in reply.choices[0].logprobs.content or []
    ]


async def test_temperature_zero_is_deterministic(client: openai.AsyncOpenAI) -> None:
    replies = [
        await client.chat.completions.create(
            model="policy", messages=USER, max_tokens=10, temperature=0
        )
        for _ in range(2)
    ]
    assert extra(replies[0].choices[0], "token_ids") == extra(replies[1].choices[0], "token_ids")


async def test_concurrent_requests_are_batched_and_keep_their_seeds(
    server: AgentServer, client: openai.AsyncOpenAI
) -> None:
    async def ask(seed: int) -> list[int]:
        reply = await client.chat.completions.create(
            model="policy", messages=USER, max_tokens=6, seed=seed
        )
        return extra(reply.choices[0], "token_ids")

    together = await asyncio.gather(*(ask(seed) for seed in range(6)))
    alone = [await ask(seed) for seed in range(6)]
    assert together == alone
    assert server.statistics()["sampler"]["largest_batch"] > 1


async def test_concurrent_streams_share_batches_and_each_gets_its_own_tokens(
    policy: tuple[Any, Any],
) -> None:
    async with (
        serve(hf_engine(policy), policy[1]) as server,
        openai_client(f"{server.url}/v1") as client,
    ):

        async def streamed(seed: int) -> tuple[str, list[int]]:
            stream = await client.chat.completions.create(
                model="policy", messages=USER, max_tokens=24, seed=seed, n=2, stream=True
            )
            text, ids = ["", ""], [[], []]
            async for chunk in stream:
                for c in chunk.choices:
                    text[c.index] += c.delta.content or ""
                    if c.finish_reason:
                        ids[c.index] = extra(c, "token_ids")
            return text, ids

        async def whole(seed: int) -> tuple[str, list[int]]:
            reply = await client.chat.completions.create(
                model="policy", messages=USER, max_tokens=24, seed=seed, n=2
            )
            return (
                [c.message.content for c in reply.choices],
                [extra(c, "token_ids") for c in reply.choices],
            )

        together = await asyncio.gather(*(streamed(seed) for seed in range(4)))
        assert server.statistics()["sampler"]["largest_batch"] > 1  # streams batched together
        assert together == [await whole(seed) for seed in range(4)]


async def test_streaming_sends_tokens_as_they_are_sampled(policy: tuple[Any, Any]) -> None:
    """The first chunk reaches the client while the engine is still decoding: the engine's
    21st forward pass waits until the client has a chunk in hand (with chunks sent only after
    the generation, it would wait forever: 30 s, then the test fails)."""
    model, tokenizer = policy
    end = [tokenizer.convert_tokens_to_ids(IM_END), *stop_token_ids(tokenizer)]
    in_hand = threading.Event()
    waited: list[bool] = []
    forwards = [0]

    def hold(module: Any, args: Any, output: Any) -> None:
        forwards[0] += 1
        if forwards[0] == 21:
            waited.append(in_hand.wait(timeout=30))

    async with (
        serve(hf_engine(policy), tokenizer) as server,
        openai_client(f"{server.url}/v1") as client,
    ):
        handle = model.register_forward_hook(hold)
        try:
            started = time.perf_counter()
            stream = await client.chat.completions.create(
                model="policy",
                messages=USER,
                max_tokens=311,
                seed=1,
                logit_bias={str(t): -100 for t in set(end)},  # no early stop: all 311 tokens
                stream=True,
            )
            arrivals, text = [], ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    in_hand.set()
                    arrivals.append(time.perf_counter() - started)
                    text += chunk.choices[0].delta.content
                if chunk.choices and chunk.choices[0].finish_reason:
                    ids = extra(chunk.choices[0], "token_ids")
        finally:
            handle.remove()
    assert waited == [True]
    assert len(ids) == 311 and text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(arrivals) > 100  # a piece per token or so, not one lump at the end
    print(f"first chunk {arrivals[0]:.3f}s, last {arrivals[-1]:.3f}s, {len(arrivals)} chunks")


# --------------------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


async def test_tool_calls_and_their_results_continue_the_session(
    policy: tuple[Any, Any], finished: Finished
) -> None:
    tokenizer = policy[1]
    engine = ScriptedEngine(tokenizer, [CALL, "It is sunny in Paris."])
    async with (
        serve(engine, tokenizer, on_finish=finished) as server,
        openai_client(server.session_url("trip")) as client,
    ):
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=100
        )
        [choice] = first.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        reply_ids = extra(choice, "token_ids")
        assert reply_ids == [*tokenizer.encode(CALL), tokenizer.convert_tokens_to_ids(IM_END)]
        assert extra(first, "prompt_token_ids") == prompt_ids(tokenizer, messages, TOOLS)

        # The agent sends the assistant message back as the client returned it, plus the result.
        result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}
        messages += [choice.message, result]
        second = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=100
        )
        assert second.choices[0].finish_reason == "stop"
        assert second.choices[0].message.content == "It is sunny in Paris."
        assert second.choices[0].message.tool_calls is None
        expected = (
            extra(first, "prompt_token_ids")
            + reply_ids
            + continuation_ids(tokenizer, reply_ids, [result])
        )
        assert extra(second, "prompt_token_ids") == expected == engine.prompts[1]
        tokens = len(expected) + len(extra(second.choices[0], "token_ids"))
        assert await finish(server, "trip", reward=1.0) == (
            200,
            {"session": "trip", "tokens": tokens, "turns": 2, "version": 0},
        )
    [(_, trajectory, _)] = finished.calls
    assert model_spans(trajectory.loss_mask, trajectory.response_ids) == [
        reply_ids,
        extra(second.choices[0], "token_ids"),
    ]


async def test_tool_calls_stream_and_tool_choice(policy: tuple[Any, Any]) -> None:
    tokenizer = policy[1]
    engine = ScriptedEngine(tokenizer, [CALL, CALL])
    async with (
        serve(engine, tokenizer) as server,
        openai_client(f"{server.url}/v1") as client,
    ):
        messages = [{"role": "user", "content": "Weather?"}]
        stream = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=100, stream=True
        )
        chunks = [c.choices[0] async for c in stream]
        calls = [d for c in chunks for d in c.delta.tool_calls or []]
        assert [(d.index, d.function.name) for d in calls] == [(0, "get_weather")]
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
        assert "".join(c.delta.content or "" for c in chunks) == "Let me check."
        assert chunks[-1].finish_reason == "tool_calls"
        # tool_choice "none": the text is the model's, unparsed.
        plain = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=100
        )
        assert plain.choices[0].message.content == CALL
        assert plain.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, tool_choice="required"
            )
        assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


# --------------------------------------------------------------------------- sessions


async def test_a_session_records_a_token_exact_trajectory(
    server: AgentServer, policy: tuple[Any, Any], finished: Finished
) -> None:
    tokenizer = policy[1]
    messages: list[Any] = [{"role": "system", "content": "Be brief."}]
    replies = []
    async with openai_client(server.session_url("agent-1")) as client:
        for turn, question in enumerate(["Hi", "And then?", "Why?"]):
            messages.append({"role": "user", "content": question})
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=6, logprobs=True, seed=turn
            )
            assert extra(reply, "relax") == {"version": 0, "session": "agent-1"}
            replies.append(reply)
            messages.append(reply.choices[0].message)  # the agent keeps the returned message
    status, body = await finish(server, "agent-1", reward=0.5, task="greet")
    assert status == 200 and body["turns"] == 3 and body["session"] == "agent-1"
    [(session, trajectory, sent)] = finished.calls
    assert session == "agent-1" and sent == {"reward": 0.5, "choice": 0, "task": "greet"}
    assert (
        trajectory.reward == 0.5 and trajectory.end == "done" and len(trajectory) == body["tokens"]
    )

    returned = [extra(r.choices[0], "token_ids") for r in replies]
    assert model_spans(trajectory.loss_mask, trajectory.response_ids) == returned
    assert trajectory.prompt_ids == extra(replies[0], "prompt_token_ids")
    # Each call was prompted with the trajectory so far, the model's ids never re-tokenised.
    for reply in replies:
        prompt = extra(reply, "prompt_token_ids")
        assert trajectory.ids[: len(prompt)] == prompt
    # Observations (the user turns and the template around them) are masked out.
    observed = [
        t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if not m
    ]
    assert "And then?" in tokenizer.decode(observed) and "Why?" in tokenizer.decode(observed)
    trained = [lp for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m]
    assert trained == [c.logprob for r in replies for c in r.choices[0].logprobs.content]
    stats = server.statistics()["sessions"]
    assert stats["continued"] == 2 and stats["segments_dropped"] == 0 and stats["finished"] == 1
    # Finished is gone: finishing again is a 404.
    status, body = await finish(server, "agent-1", reward=1.0)
    assert status == 404 and body["error"]["type"] == "not_found_error"


async def test_an_moe_session_s_trajectory_carries_each_token_s_routing(tmp_path: Path) -> None:
    """R3 through the endpoint: a session of an MoE policy finishes with one routing record
    per token, each from the call that processed it first, and all of it what one
    teacher-forced pass of the trajectory routes; tokens after the last reply unrecorded."""
    from relax.models import RoutingRecorder

    init = ModelInitConfig(**{**TINY.model_dump(), "arch": "qwen3_moe", "seed": 2})
    moe = HFEngine.from_pretrained(build_tiny_model(init, tmp_path))
    finished = Finished()
    messages: list[Any] = []
    async with (
        serve(moe, moe.tokenizer, on_finish=finished) as server,
        openai_client(server.session_url("moe")) as client,
    ):
        for turn, question in enumerate(["Hi", "And then?"]):
            messages.append({"role": "user", "content": question})
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=5, seed=turn
            )
            messages.append(reply.choices[0].message)
        status, _ = await finish(server, "moe", reward=1.0)
    assert status == 200
    [(_, trajectory, _)] = finished.calls
    ids = trajectory.ids
    routed = trajectory.routing()
    assert routed is not None and tuple(routed.shape) == (len(ids), 1, 2)
    last_reply_end = len(trajectory.prompt_ids) + max(
        i + 1 for i, m in enumerate(trajectory.loss_mask) if m
    )
    recorded = (routed < 8).all(-1).all(-1)
    assert recorded[: last_reply_end - 1].all() and not recorded[last_reply_end - 1 :].any()
    with RoutingRecorder(moe.model) as rec, torch.no_grad():
        moe.model(input_ids=torch.tensor([ids]))
    forced = rec.pass_ids(0).permute(1, 0, 2)[: last_reply_end - 1].sort(-1).values
    assert torch.equal(forced, routed[: last_reply_end - 1].long().sort(-1).values)
    assert "routed_experts" in trajectory.columns()


async def test_a_rewritten_history_starts_a_new_segment(
    server: AgentServer, finished: Finished
) -> None:
    async with openai_client(f"{server.url}/v1") as client:
        kwargs: dict[str, Any] = {"model": "policy", "max_tokens": 4}
        header = {"X-Relax-Session": "rw"}  # the header selects a session too
        first = await client.chat.completions.create(
            messages=[{"role": "user", "content": "one"}], extra_headers=header, **kwargs
        )
        # The same conversation again (a retry) does not break the segment...
        await client.chat.completions.create(
            messages=[{"role": "user", "content": "one"}], extra_headers=header, **kwargs
        )
        assert server.statistics()["sessions"]["segments_dropped"] == 0
        # ...a rewritten one does.
        messages: list[Any] = [
            {"role": "user", "content": "one, summarised"},
            first.choices[0].message,
            {"role": "user", "content": "two"},
        ]
        second = await client.chat.completions.create(
            messages=messages, extra_headers=header, **kwargs
        )
    assert server.statistics()["sessions"]["segments_dropped"] == 1
    assert (await finish(server, "rw", reward=1.0))[0] == 200
    [(_, trajectory, _)] = finished.calls
    assert trajectory.prompt_ids == extra(second, "prompt_token_ids")
    assert model_spans(trajectory.loss_mask, trajectory.response_ids) == [
        extra(second.choices[0], "token_ids")
    ]


async def test_a_completions_session(
    server: AgentServer, finished: Finished, policy: tuple[Any, Any]
) -> None:
    async with openai_client(server.session_url("text")) as client:
        first = await client.completions.create(model="policy", prompt="Q: 1+1?\nA:", max_tokens=4)
        text = "Q: 1+1?\nA:" + first.choices[0].text + "\nQ: 2+2?\nA:"
        second = await client.completions.create(model="policy", prompt=text, max_tokens=4)
    ids = extra(first.choices[0], "token_ids")
    # The reply's sampled ids, not the re-encoding of its text, continue the prompt.
    assert extra(second, "prompt_token_ids") == [
        *extra(first, "prompt_token_ids"),
        *ids,
        *policy[1].encode("\nQ: 2+2?\nA:"),
    ]
    assert (await finish(server, "text", reward=0.0))[0] == 200
    trajectory = finished.calls[0][1]
    assert model_spans(trajectory.loss_mask, trajectory.response_ids)[0] == ids


# --------------------------------------------------------------------------- bad input


async def expect(
    kind: type[openai.APIStatusError], call: Any, *, status: int, param: str | None = None
) -> dict[str, Any]:
    with pytest.raises(kind) as info:
        await call
    error = info.value
    assert error.status_code == status
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code"}
    assert error.body["param"] == param
    assert error.body["message"] in str(error)  # the message reaches the caller intact
    return error.body


async def test_bad_requests_are_openai_errors(
    server: AgentServer, client: openai.AsyncOpenAI
) -> None:
    chat = client.chat.completions.create
    ok: dict[str, Any] = {"model": "policy", "messages": USER, "max_tokens": 2}
    bad = openai.BadRequestError
    body = await expect(
        bad,
        client.post("/chat/completions", cast_to=object, body={"model": "policy"}),
        status=400,
        param="messages",
    )
    assert "missing" in body["message"] and body["type"] == "invalid_request_error"
    await expect(bad, chat(**{**ok, "n": 0}), status=400, param="n")
    await expect(bad, chat(**{**ok, "n": 17}), status=400, param="n")
    body = await expect(bad, chat(**{**ok, "temperature": 5}), status=400, param="temperature")
    assert "temperature" in body["message"]
    await expect(bad, chat(**{**ok, "stop": ["a", "b", "c", "d", "e"]}), status=400, param="stop")
    body = await expect(bad, chat(**{**ok, "top_logprobs": 3}), status=400, param="top_logprobs")
    assert "needs logprobs: true" in body["message"]
    await expect(
        bad, chat(**{**ok, "logprobs": True, "top_logprobs": 21}), status=400, param="top_logprobs"
    )
    body = await expect(
        bad,
        chat(**{**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        status=400,
        param="messages[0].content",
    )
    assert "image_url" in body["message"]
    await expect(
        bad,
        chat(**{**ok, "messages": [{"role": "wizard", "content": "x"}]}),
        status=400,
        param="messages[0].role",
    )
    body = await expect(
        openai.NotFoundError, chat(**{**ok, "model": "gpt-9"}), status=404, param="model"
    )
    assert body["code"] == "model_not_found" and body["type"] == "not_found_error"
    # Too long for max_model_len.
    body = await expect(
        bad,
        chat(**{**ok, "messages": [{"role": "user", "content": "x" * MAX_LEN}]}),
        status=400,
        param="messages",
    )
    assert body["code"] == "context_length_exceeded"
    body = await expect(
        bad,
        client.completions.create(model="policy", prompt="x" * 500, max_tokens=100),
        status=400,
        param="prompt",
    )
    assert str(MAX_LEN) in body["message"]

    completions = client.completions.create
    await expect(bad, completions(model="policy", prompt="a", echo=True), status=400, param="echo")
    await expect(bad, completions(model="policy", prompt=["a", "b"]), status=400, param="prompt")
    await expect(
        bad, completions(model="policy", prompt="a", logprobs=6), status=400, param="logprobs"
    )
    # The engine refuses the prompt: still a 400, with its reason.
    body = await expect(
        bad, completions(model="policy", prompt=[999_999]), status=400, param="prompt"
    )
    assert "outside" in body["message"]
    stats = server.statistics()
    assert stats["errors"]["invalid_request_error"] >= 13
    assert stats["errors"]["not_found_error"] == 1
    assert stats["requests"]["chat"] >= 10 and stats["requests"]["completions"] >= 5


async def test_authentication(server: AgentServer) -> None:
    async with openai_client(f"{server.url}/v1", api_key="wrong") as client:
        body = await expect(
            openai.AuthenticationError,
            client.chat.completions.create(model="policy", messages=USER),
            status=401,
        )
        assert body["type"] == "authentication_error"
    status, body = await raw("GET", f"{server.url}/v1/models", key=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "Authorization: Bearer" in body["error"]["message"]
    assert (await raw("GET", f"{server.url}/relax/v1/version", key="nope"))[0] == 401
    assert server.statistics()["errors"]["authentication_error"] == 3


async def test_raw_error_bodies(server: AgentServer) -> None:
    """The exact shape of an error answer, seen without the openai client."""
    status, body = await raw("POST", f"{server.url}/v1/chat/completions", data=b"{not json")
    assert status == 400
    assert body == {
        "error": {
            "message": body["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert "not valid JSON" in body["error"]["message"]
    status, body = await raw("POST", f"{server.url}/v1/chat/completions", json=[1, 2])
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = await raw("POST", f"{server.url}/v1/chat/completions", json={"n": 1})
    assert (status, body["error"]["param"]) == (400, "messages")
    status, body = await raw("GET", f"{server.url}/v1/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = await raw("GET", f"{server.url}/v1/chat/completions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, body = await finish(server, "nobody", reward=1.0)
    assert status == 404 and body["error"]["code"] == "session_not_found"
    status, body = await raw(
        "POST", f"{server.url}/relax/v1/sessions/x/finish", json={"reward": "lots"}
    )
    assert status == 400 and body["error"]["param"] == "reward"


async def test_an_engine_failure_is_a_500(policy: tuple[Any, Any]) -> None:
    engine = ScriptedEngine(policy[1], [])
    engine.fail = True
    async with serve(engine, policy[1]) as server, openai_client(f"{server.url}/v1") as client:
        body = await expect(
            openai.InternalServerError,
            client.chat.completions.create(model="policy", messages=USER),
            status=500,
        )
        assert body["type"] == "server_error" and "caught fire" in body["message"]


async def test_a_disconnected_client_cancels_its_request(policy: tuple[Any, Any]) -> None:
    engine = ScriptedEngine(policy[1], ["late", "on time"])
    engine.gate = asyncio.Event()
    async with serve(engine, policy[1]) as server, openai_client(f"{server.url}/v1") as client:
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="policy", messages=USER, timeout=0.3)
        for _ in range(500):
            if server.statistics()["cancelled"]:
                break
            await asyncio.sleep(0.01)
        stats = server.statistics()
        assert stats["cancelled"] == 1 and stats["sampler"]["cancelled"] == 1
        engine.gate.set()
        reply = await client.chat.completions.create(model="policy", messages=USER)
        assert reply.choices[0].message.content == "on time"


# --------------------------------------------------------------------------- never ignored


async def test_fields_the_endpoint_cannot_honour_are_refused_by_name(
    server: AgentServer, client: openai.AsyncOpenAI
) -> None:
    """Each of these used to be accepted and silently ignored: the reply looked fine and was
    not what the caller asked for."""
    chat = client.chat.completions.create
    ok: dict[str, Any] = {"model": "policy", "messages": USER, "max_tokens": 2}
    bad = openai.BadRequestError
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        body = await expect(
            bad, chat(**ok, response_format=fmt), status=400, param="response_format"
        )
        assert body["code"] == "unsupported_parameter" and "text" in body["message"]
    assert (await chat(**ok, response_format={"type": "text"})).choices  # text is what we do
    await expect(
        bad, chat(**ok, parallel_tool_calls=False), status=400, param="parallel_tool_calls"
    )
    await expect(bad, chat(**ok, modalities=["text", "audio"]), status=400, param="modalities")
    await expect(bad, chat(**ok, reasoning_effort="high"), status=400, param="reasoning_effort")
    # A field the endpoint does not know at all (a vLLM extension, a typo) is refused too.
    for name in ("min_p", "repetition_penalty", "temprature"):
        body = await expect(bad, chat(**ok, extra_body={name: 0.5}), status=400, param=name)
        assert body["code"] == "unrecognized_parameter"
    completions = client.completions.create
    await expect(
        bad, completions(model="policy", prompt="a", suffix="!"), status=400, param="suffix"
    )
    await expect(
        bad, completions(model="policy", prompt="a", best_of=3), status=400, param="best_of"
    )
    # Out of OpenAI's ranges, or naming tokens that do not exist.
    await expect(bad, chat(**ok, presence_penalty=2.5), status=400, param="presence_penalty")
    await expect(bad, chat(**ok, frequency_penalty=-3), status=400, param="frequency_penalty")
    await expect(bad, chat(**ok, logit_bias={"5": 101}), status=400, param="logit_bias")
    await expect(bad, chat(**ok, logit_bias={"x": 1}), status=400, param="logit_bias")
    await expect(bad, chat(**ok, logit_bias={"99999": 1}), status=400, param="logit_bias")
    # Harmless bookkeeping fields are accepted.
    assert (await chat(**ok, user="u", store=False, metadata={"a": "b"})).choices


async def test_logit_bias_and_penalties_shape_what_is_sampled(
    client: openai.AsyncOpenAI, policy: tuple[Any, Any]
) -> None:
    model, tokenizer = policy
    a = tokenizer.encode("A")[0]
    # A +100 bias all but forces "A": the reply and its recorded logprobs show it.
    reply = await client.completions.create(
        model="policy", prompt="Hello", max_tokens=5, seed=0, logit_bias={str(a): 100}, logprobs=0
    )
    [choice] = reply.choices
    assert choice.text == "AAAAA"
    assert all(lp > -1e-3 for lp in choice.logprobs.token_logprobs)  # type: ignore[union-attr]
    # Penalties: the logprobs returned are of the penalised distribution (recomputed by hand:
    # OpenAI's formula over the tokens sampled so far).
    presence, frequency = 0.7, 1.1
    reply = await client.completions.create(
        model="policy",
        prompt="Hello",
        max_tokens=10,
        seed=3,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logprobs=0,
    )
    [choice] = reply.choices
    ids = extra(choice, "token_ids")
    prompt = tokenizer.encode("Hello")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    for t in range(len(ids)):
        for token in set(ids[:t]):
            logits[t, token] -= frequency * ids[:t].count(token) + presence
    want = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)  # type: ignore[union-attr]
    # Without them, the same seed samples from another distribution (they were not ignored).
    plain = await client.completions.create(
        model="policy", prompt="Hello", max_tokens=10, seed=3, logprobs=0
    )
    assert plain.choices[0].logprobs.token_logprobs != choice.logprobs.token_logprobs  # type: ignore[union-attr]


async def test_finish_refuses_a_reward_that_is_not_a_finite_number(
    server: AgentServer, client: openai.AsyncOpenAI, finished: Finished
) -> None:
    """A NaN reward used to be stored (200), and then the trainer skipped the whole step it
    landed in, valid groups included. Refused, it loses nothing: the session is still open and
    a good reward finishes it."""
    async with openai_client(server.session_url("nan")) as session_client:
        await session_client.chat.completions.create(model="policy", messages=USER, max_tokens=3)
    for reward in (math.nan, math.inf, -math.inf):  # json.dumps writes NaN, Infinity
        status, body = await finish(server, "nan", reward=reward)
        assert status == 400 and body["error"]["param"] == "reward", body
        assert "finite number" in body["error"]["message"]
    for reward in ("1.0", True, None, [1.0]):
        status, body = await finish(server, "nan", reward=reward)
        assert status == 400 and body["error"]["param"] == "reward", (reward, body)
    for field, value in (("group_size", 0), ("group_size", "4"), ("choice", -1)):
        status, body = await finish(server, "nan", reward=1.0, **{field: value})
        assert status == 400 and body["error"]["param"] == field, (field, body)
    assert finished.calls == []  # nothing was handed on
    status, body = await finish(server, "nan", reward=1, group="g", group_size=2)
    assert status == 200 and body["session"] == "nan"
    [(_, trajectory, sent)] = finished.calls
    assert trajectory.reward == 1.0 and sent["group_size"] == 2
