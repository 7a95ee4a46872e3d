"""HFEngine's processed distribution: logit_bias, presence/frequency penalties, top-N logprobs
and per-token streaming — each checked against an independent recomputation from the model's
own logits (one unpadded forward pass of prompt + response)."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest
import torch

from relax.config import ModelInitConfig
from relax.engines import EngineError, Generation, HFEngine, SamplingParams, TokenEvent
from relax.models import build_tiny_model, load_policy

pytestmark = pytest.mark.anyio

PROMPTS = [[257, 104, 105], [257, 50, 43, 50, 61, 32, 119, 104, 97, 116, 63]]
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(ModelInitConfig(**TINY, seed=0), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> torch.nn.Module:
    return load_policy(tiny_dir)[0]


@pytest.fixture
def engine(tiny_dir: Path) -> HFEngine:
    return HFEngine.from_pretrained(tiny_dir, max_batch_size=8)


def raw_logits(model: torch.nn.Module, gen: Generation) -> torch.Tensor:
    """The model's logits at each generated position, [len(response), vocab]."""
    ids = torch.tensor([gen.prompt_ids + gen.response_ids])
    with torch.no_grad():
        return model(ids).logits[0, len(gen.prompt_ids) - 1 : -1].float()


def penalised(
    logits: torch.Tensor, response: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's penalties, written out by hand: position t counts response[:t]."""
    out = logits.clone()
    for t in range(len(response)):
        for token in set(response[:t]):
            count = response[:t].count(token)
            out[t, token] -= frequency * count + presence
    return out


async def test_top_logprobs_are_the_top_of_the_sampled_distribution(
    engine: HFEngine, reference: torch.nn.Module
) -> None:
    gens = await engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.7, n=2, seed=3, top_logprobs=5)
    )
    for gen in gens:
        expected = (raw_logits(reference, gen) / 0.7).log_softmax(-1)
        assert gen.top_logprobs is not None and len(gen.top_logprobs) == len(gen.response_ids)
        for t, top in enumerate(gen.top_logprobs):
            values, ids = expected[t].topk(5)
            assert [i for i, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
            # The sampled token's own logprob is of the same distribution.
            assert gen.logprobs[t] == pytest.approx(
                float(expected[t, gen.response_ids[t]]), abs=1e-4
            )
    # Not asked: not recorded.
    [plain] = await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=3))
    assert plain.top_logprobs is None


async def test_top_logprobs_leave_out_what_truncation_removed(
    engine: HFEngine, reference: torch.nn.Module
) -> None:
    [gen] = await engine.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=6, top_k=3, seed=1, top_logprobs=5)
    )
    assert gen.top_logprobs is not None
    for t, top in enumerate(gen.top_logprobs):
        assert len(top) == 3  # only 3 tokens can be drawn: the other two are not "likely"
        values, ids = raw_logits(reference, gen)[t].topk(3)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.log_softmax(-1).tolist(), abs=1e-4)


async def test_logit_bias_shapes_the_sampled_distribution(
    engine: HFEngine, reference: torch.nn.Module
) -> None:
    # A strong bias all but forces token 65 ("A"); -100 bans the model's own favourite.
    [forced] = await engine.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=6, seed=0, logit_bias={65: 100.0})
    )
    assert forced.response_ids == [65] * 6
    [greedy] = await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0))
    favourite = greedy.response_ids[0]
    bias = {favourite: -100.0, 66: 3.5}
    gens = await engine.generate(
        PROMPTS,
        SamplingParams(max_new_tokens=8, temperature=0.9, seed=5, logit_bias=bias, top_logprobs=3),
    )
    for gen in gens:
        logits = raw_logits(reference, gen)
        for token, b in bias.items():
            logits[:, token] += b
        expected = (logits / 0.9).log_softmax(-1)
        got = torch.tensor(gen.logprobs)
        want = expected.gather(-1, torch.tensor(gen.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(got, want, atol=1e-4)  # the recorded logprob includes the bias
        assert gen.top_logprobs is not None
        assert [i for i, _ in gen.top_logprobs[0]] == expected[0].topk(3).indices.tolist()
    assert favourite not in gens[0].response_ids[:1]


async def test_presence_and_frequency_penalties(
    engine: HFEngine, reference: torch.nn.Module
) -> None:
    presence, frequency = 0.8, 0.6
    gens = await engine.generate(
        PROMPTS,
        SamplingParams(
            max_new_tokens=12,
            temperature=1.0,
            seed=9,
            presence_penalty=presence,
            frequency_penalty=frequency,
        ),
    )
    for gen in gens:
        logits = penalised(raw_logits(reference, gen), gen.response_ids, presence, frequency)
        want = logits.log_softmax(-1).gather(-1, torch.tensor(gen.response_ids)[:, None])
        assert torch.allclose(torch.tensor(gen.logprobs), want.squeeze(-1), atol=1e-4)
    # Greedy with a large frequency penalty never repeats a token (it always would without:
    # a random tiny model's argmax soon loops).
    [looping] = await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16, temperature=0))
    [varied] = await engine.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=16, temperature=0, frequency_penalty=50.0)
    )
    assert len(set(looping.response_ids)) < 16
    assert len(set(varied.response_ids)) == 16


async def test_streamed_tokens_arrive_while_decoding_and_match_the_result(
    engine: HFEngine,
) -> None:
    events: list[TokenEvent] = []
    loop = asyncio.get_running_loop()
    seen = threading.Event()  # the loop has received a token
    waited: list[bool] = []

    def on_token(step: list[TokenEvent]) -> None:
        assert asyncio.get_running_loop() is loop  # called on the loop, not the worker
        events.extend(step)
        seen.set()

    def hold(module: torch.nn.Module, args: object, output: object) -> None:
        # The 5th forward pass (4 tokens sampled) waits until the loop has heard of a token:
        # with tokens handed over only at the end this wait would time out.
        calls.append(1)
        if len(calls) == 5:
            waited.append(seen.wait(timeout=30))

    calls: list[int] = []
    handle = engine.model.register_forward_hook(hold)
    try:
        gens = await engine.generate(
            PROMPTS,
            SamplingParams(max_new_tokens=40, n=2, seed=4, top_logprobs=2),
            on_token=on_token,
        )
    finally:
        handle.remove()
    assert waited == [True]
    for seq, gen in enumerate(gens):
        mine = [e for e in events if e.sequence == seq]
        assert [e.token_id for e in mine] == gen.response_ids
        assert [e.logprob for e in mine] == gen.logprobs
        assert [list(e.top_logprobs) for e in mine] == gen.top_logprobs
        assert all(e.version == 0 for e in mine)
    # A row's stop token is its last event.
    stop = gens[0].response_ids[2]
    events.clear()
    gens = await engine.generate(
        PROMPTS,
        SamplingParams(max_new_tokens=40, n=2, seed=4, stop_token_ids=[stop]),
        on_token=on_token,
    )
    assert gens[0].response_ids[-1] == stop and gens[0].finish_reason == "stop"
    for seq, gen in enumerate(gens):
        assert [e.token_id for e in events if e.sequence == seq] == gen.response_ids


async def test_bad_processed_arguments_are_refused(engine: HFEngine) -> None:
    with pytest.raises(EngineError, match="logit_bias has token ids outside"):
        await engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, logit_bias={512: 1.0}))
    with pytest.raises(EngineError, match="presence_penalty must be a finite"):
        await engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, presence_penalty=math.nan))
    with pytest.raises(EngineError, match="finite biases"):
        await engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, logit_bias={3: math.inf}))
    with pytest.raises(EngineError, match="top_logprobs"):
        await engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, top_logprobs=-1))
