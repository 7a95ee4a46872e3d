"""HFEngine: shapes, stop/length, logprobs that match a recomputation, seeds, n, weight swaps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from relax.config import ModelInitConfig
from relax.engines import (
    EngineError,
    Generation,
    GenerationEngine,
    HFEngine,
    build_tiny_model,
    load_policy,
)
from tests.actors.helpers import wait_until

pytestmark = pytest.mark.anyio

PROMPTS = [
    [257, 104, 105],
    [257, 50, 43, 50, 61, 32, 119, 104, 97, 116, 63],
]  # ragged: left padding

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}
"""The tiny model of every engine test: 2 layers, hidden 64, vocab 512."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(ModelInitConfig(**TINY, seed=0), tmp_path_factory.mktemp("tiny0"))


@pytest.fixture(scope="module")
def tiny_dir_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes, another seed: the "next version" of the weights."""
    return build_tiny_model(ModelInitConfig(**TINY, seed=1), tmp_path_factory.mktemp("tiny1"))


@pytest.fixture
def engine(tiny_dir: Path) -> HFEngine:
    return HFEngine.from_pretrained(tiny_dir, max_batch_size=8)


@pytest.fixture(scope="module")
def reference_models(tiny_dir: Path, tiny_dir_other: Path) -> dict[int, torch.nn.Module]:
    """Independent copies of the version-0 and version-1 weights, for recomputation."""
    return {0: load_policy(tiny_dir)[0], 1: load_policy(tiny_dir_other)[0]}


def recompute(model: torch.nn.Module, gen: Generation, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at each generated position, from one unpadded forward pass."""
    ids = torch.tensor([gen.prompt_ids + gen.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(gen.prompt_ids) - 1 : -1].float() / temperature
    return (
        logits.log_softmax(-1).gather(-1, torch.tensor(gen.response_ids).unsqueeze(-1)).squeeze(-1)
    )


def close(gen: Generation, model: torch.nn.Module, temperature: float = 1.0) -> bool:
    return torch.allclose(torch.tensor(gen.logprobs), recompute(model, gen, temperature), atol=1e-4)


async def test_shapes_and_length(engine: HFEngine) -> None:
    assert isinstance(engine, GenerationEngine) and engine.version == 0
    gens = await engine.generate(PROMPTS, max_new_tokens=6, stop_token_ids=[], seed=0)
    assert len(gens) == 2
    for gen, prompt in zip(gens, PROMPTS, strict=True):
        assert gen.prompt_ids == prompt
        assert len(gen.response_ids) == len(gen.logprobs) == 6
        assert gen.finish_reason == "length" and gen.version == 0
        assert all(lp <= 0 for lp in gen.logprobs)
    stats = engine.statistics()
    assert stats["requests"] == 1 and stats["sequences"] == 2 and stats["generated_tokens"] == 12


async def test_stop_token_ends_the_response(engine: HFEngine) -> None:
    # Greedy decoding is deterministic: take its 3rd token as the stop token.
    free = await engine.generate(PROMPTS[:1], max_new_tokens=8, temperature=0)
    stop = free[0].response_ids[2]
    first = free[0].response_ids.index(stop)
    stopped = await engine.generate(PROMPTS, max_new_tokens=8, temperature=0, stop_token_ids=[stop])
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].response_ids == free[0].response_ids[: first + 1]  # stop token kept, rest cut
    assert len(stopped[0].logprobs) == first + 1
    other = stopped[1]
    assert (other.finish_reason == "stop") == (stop in other.response_ids)
    assert stop not in other.response_ids[:-1]  # nothing after a stop, padding included
    if other.finish_reason == "length":
        assert len(other.response_ids) == 8


@pytest.mark.parametrize(("temperature", "n"), [(1.0, 1), (0.7, 2), (1.5, 1), (0.0, 1)])
async def test_logprobs_equal_a_recomputation(
    engine: HFEngine, reference_models: dict[int, torch.nn.Module], temperature: float, n: int
) -> None:
    gens = await engine.generate(PROMPTS, max_new_tokens=12, temperature=temperature, n=n, seed=3)
    for gen in gens:
        assert close(gen, reference_models[0], temperature or 1.0)  # greedy reports T = 1


async def test_logprobs_are_under_truncation_when_top_k_is_set(
    engine: HFEngine, reference_models: dict[int, torch.nn.Module]
) -> None:
    # With top-k the reported distribution is the renormalised top-k one: never below plain.
    gens = await engine.generate(PROMPTS, max_new_tokens=8, top_k=5, seed=0)
    for gen in gens:
        plain = recompute(reference_models[0], gen)
        assert (torch.tensor(gen.logprobs) > plain + 1e-3).all()


async def test_same_seed_same_output(engine: HFEngine) -> None:
    kwargs = {"max_new_tokens": 10, "temperature": 1.0, "n": 2}
    a = await engine.generate(PROMPTS, seed=11, **kwargs)
    b = await engine.generate(PROMPTS, seed=11, **kwargs)
    c = await engine.generate(PROMPTS, seed=12, **kwargs)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]


async def test_n_samples_per_prompt_grouped(engine: HFEngine) -> None:
    gens = await engine.generate(PROMPTS, max_new_tokens=10, n=2, seed=5)
    assert len(gens) == 4
    assert [g.prompt_ids for g in gens] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    assert [g.index for g in gens] == [0, 1, 0, 1]
    assert gens[0].response_ids != gens[1].response_ids  # independent samples


async def test_batch_chunks_give_the_same_answers(tiny_dir: Path) -> None:
    # Greedy output must not depend on how sequences are batched (left padding is correct).
    wide = HFEngine.from_pretrained(tiny_dir, max_batch_size=8)
    narrow = HFEngine.from_pretrained(tiny_dir, max_batch_size=1)
    a = await wide.generate(PROMPTS, max_new_tokens=8, temperature=0)
    b = await narrow.generate(PROMPTS, max_new_tokens=8, temperature=0)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]


async def test_load_weights_changes_outputs_and_version(
    engine: HFEngine, reference_models: dict[int, torch.nn.Module]
) -> None:
    before = await engine.generate(PROMPTS, max_new_tokens=8, temperature=0)
    await engine.load_weights(1, reference_models[1].state_dict())
    assert engine.version == 1 and engine.statistics()["weight_loads"] == 1
    after = await engine.generate(PROMPTS, max_new_tokens=8, temperature=0)
    assert [g.response_ids for g in before] != [g.response_ids for g in after]
    assert all(g.version == 1 and close(g, reference_models[1]) for g in after)


async def test_concurrent_generation_and_weight_load_never_mix(
    engine: HFEngine, reference_models: dict[int, torch.nn.Module]
) -> None:
    new_weights = {k: v.clone() for k, v in reference_models[1].state_dict().items()}
    kwargs = {"max_new_tokens": 24, "seed": 0}
    first = asyncio.create_task(engine.generate(PROMPTS * 4, **kwargs))
    await asyncio.sleep(0)  # let it take the engine
    load = asyncio.create_task(engine.load_weights(1, new_weights))
    second = asyncio.create_task(engine.generate(PROMPTS * 4, **kwargs))
    gens_first, _, gens_second = await asyncio.gather(first, load, second)
    assert {g.version for g in gens_first} == {0} and {g.version for g in gens_second} == {1}
    for gen in gens_first + gens_second:
        # The reported version's weights explain every logprob; the other version's do not.
        assert close(gen, reference_models[gen.version])
        assert not close(gen, reference_models[1 - gen.version])


async def test_event_loop_keeps_serving_during_generation(engine: HFEngine) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    await engine.generate(PROMPTS * 8, max_new_tokens=32, seed=0)
    task.cancel()
    assert ticks > 3


async def test_bad_weight_updates_change_nothing(
    engine: HFEngine, reference_models: dict[int, torch.nn.Module]
) -> None:
    before = await engine.generate(PROMPTS, max_new_tokens=6, temperature=0)
    weights = {k: v.clone() for k, v in reference_models[1].state_dict().items()}
    name = next(iter(weights))
    wrong_shape = {**weights, name: torch.zeros(3, 3)}
    with pytest.raises(EngineError, match="shape"):
        await engine.load_weights(1, wrong_shape)
    with pytest.raises(EngineError, match="unknown weight"):
        await engine.load_weights(1, {**weights, "nope.weight": torch.zeros(1)})
    partial = dict(list(weights.items())[:3])
    with pytest.raises(EngineError, match="missing"):
        await engine.load_weights(1, partial)
    assert engine.version == 0
    assert [
        g.response_ids for g in await engine.generate(PROMPTS, max_new_tokens=6, temperature=0)
    ] == [g.response_ids for g in before]
    await engine.load_weights(2, list(weights.items()))  # (name, tensor) pairs work too
    with pytest.raises(EngineError, match="older"):
        await engine.load_weights(1, weights)
    assert engine.version == 2


async def test_bad_requests(engine: HFEngine) -> None:
    with pytest.raises(EngineError, match="empty"):
        await engine.generate([[]], max_new_tokens=4)
    with pytest.raises(EngineError, match="outside"):
        await engine.generate([[512]], max_new_tokens=4)
    with pytest.raises(EngineError, match="top_p"):
        await engine.generate(PROMPTS, max_new_tokens=4, top_p=0)
    with pytest.raises(EngineError, match="positions"):
        await engine.generate(PROMPTS, max_new_tokens=2000)
    assert await engine.generate([], max_new_tokens=4) == []


async def test_cancelled_generation_still_never_overlaps_a_load(
    engine: HFEngine, reference_models: dict[int, torch.nn.Module]
) -> None:
    # A cancelled caller releases the asyncio lock while its thread still decodes; the thread
    # lock must keep the weight swap waiting until that decode is over.
    task = asyncio.create_task(engine.generate(PROMPTS * 8, max_new_tokens=64, seed=0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.load_weights(1, reference_models[1].state_dict())
    assert engine.statistics()["requests"] == 1  # the abandoned decode finished first
    gens = await engine.generate(PROMPTS, max_new_tokens=6, seed=1)
    assert all(g.version == 1 and close(g, reference_models[1]) for g in gens)


async def test_per_prompt_seeds_do_not_depend_on_the_batch(engine: HFEngine) -> None:
    kwargs = {"max_new_tokens": 10, "n": 3}
    both = await engine.generate(PROMPTS, seed=[5, 6], **kwargs)
    alone = await engine.generate(PROMPTS[1:], seed=[6], **kwargs)
    other = await engine.generate(PROMPTS[1:], seed=[7], **kwargs)
    assert [g.response_ids for g in both[3:]] == [g.response_ids for g in alone]
    assert [g.response_ids for g in alone] != [g.response_ids for g in other]
    # The samples of one prompt differ from each other (each row has its own generator).
    assert len({tuple(g.response_ids) for g in alone}) > 1
    with pytest.raises(EngineError, match="2 seeds for 1 prompts"):
        await engine.generate(PROMPTS[:1], seed=[1, 2], max_new_tokens=2)


async def test_interruptible_engine_swaps_weights_between_tokens(
    tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    engine = HFEngine.from_pretrained(tiny_dir, max_batch_size=16, interruptible=True)
    task = asyncio.create_task(engine.generate(PROMPTS * 8, max_new_tokens=200, seed=0))
    await wait_until(lambda: engine._generating, what="the decode loop to run")
    await engine.load_weights(1, reference_models[1].state_dict())
    assert engine.version == 1  # the update landed while the generation still ran
    gens = await task
    assert engine.statistics()["interrupted_loads"] == 1
    for gen in gens:
        versions = gen.token_versions
        assert versions is not None and len(versions) == len(gen.response_ids) == 200
        switch = versions.index(1)  # one switch, from 0 to 1, at the same token for all rows
        assert switch > 0 and versions == [0] * switch + [1] * (200 - switch)
        assert gen.version == 0  # judged by its oldest token
        old = recompute(reference_models[0], gen)[:switch]
        assert torch.allclose(torch.tensor(gen.logprobs[:switch]), old, atol=1e-4)
    assert len({g.token_versions.index(1) for g in gens}) == 1
    # The next generation runs wholly on the new weights.
    after = await engine.generate(PROMPTS, max_new_tokens=6, seed=1)
    assert all(g.version == 1 and close(g, reference_models[1]) for g in after)


async def test_interruptible_engine_refuses_a_bad_update_mid_generation(
    tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    engine = HFEngine.from_pretrained(tiny_dir, max_batch_size=16, interruptible=True)
    task = asyncio.create_task(engine.generate(PROMPTS * 8, max_new_tokens=200, seed=0))
    await wait_until(lambda: engine._generating, what="the decode loop to run")
    bad = {k: v[..., :1].clone() for k, v in reference_models[1].state_dict().items()}
    with pytest.raises(EngineError, match="weight update refused"):
        await engine.load_weights(1, bad)
    gens = await task
    assert engine.version == 0
    assert all(set(g.token_versions) == {0} and close(g, reference_models[0]) for g in gens)


def test_an_offered_update_whose_caller_gave_up_is_dropped_without_harm(tiny_dir: Path) -> None:
    """A weight load cancelled while it waits for the generation in flight (a stopping rollout)
    must not break that generation: the update is dropped, the version stays."""
    engine = HFEngine.from_pretrained(tiny_dir, interruptible=True)
    other = load_policy(tiny_dir)[0].state_dict()
    engine._generating = True  # as if a generation were in flight
    offered = engine._offer(1, list(other.items()))
    assert offered is not None and offered.cancel()  # the awaiting task was cancelled
    engine._apply_pending()  # what the generation thread does between two tokens
    assert engine.version == 0
