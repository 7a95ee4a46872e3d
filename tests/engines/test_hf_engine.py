"""HFEngine: the engine contract (``tests.engines.contract``), and what is HF's own: shapes and
statistics, batch chunks, interruptible weight swaps between two tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from relax.engines import EngineError, Generation, GenerationEngine, HFEngine, SamplingParams
from relax.models import load_policy
from relax.replay import chunk_schedules
from tests.actors.helpers import wait_until
from tests.engines.contract import PROMPTS, EngineContract, Swap, close, greedy, recompute

pytestmark = pytest.mark.anyio

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}
"""The tiny model of these tests (``tiny_dir`` and co., see ``conftest``): 2 layers, hidden 64,
vocab 512."""


@pytest.fixture
def engine(tiny_dir: Path) -> HFEngine:
    return HFEngine.from_pretrained(tiny_dir, max_batch_size=8)


@pytest.fixture
def swap(engine: HFEngine) -> Swap:
    """A fresh engine per test: the contract's weight tests change its weights."""
    return Swap(engine)


class TestHFContract(EngineContract):
    """The engine contract, kept by ``HFEngine``."""


async def test_shapes_and_length(engine: HFEngine) -> None:
    assert isinstance(engine, GenerationEngine) and engine.version == 0
    gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0))
    assert len(gens) == 2
    for gen, prompt in zip(gens, PROMPTS, strict=True):
        assert gen.prompt_ids == prompt
        assert len(gen.response_ids) == len(gen.logprobs) == 6
        assert gen.finish_reason == "length" and gen.version == 0
        assert all(lp <= 0 for lp in gen.logprobs)
    stats = engine.statistics()
    assert stats["requests"] == 1 and stats["sequences"] == 2 and stats["generated_tokens"] == 12


async def test_n_samples_per_prompt_grouped(engine: HFEngine) -> None:
    gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, n=2, seed=5))
    assert len(gens) == 4
    assert [g.prompt_ids for g in gens] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    assert [g.index for g in gens] == [0, 1, 0, 1]
    assert gens[0].response_ids != gens[1].response_ids  # independent samples


async def test_batch_chunks_give_the_same_answers(tiny_dir: Path) -> None:
    # Greedy output must not depend on how sequences are batched (left padding is correct).
    wide = HFEngine.from_pretrained(tiny_dir, max_batch_size=8)
    narrow = HFEngine.from_pretrained(tiny_dir, max_batch_size=1)
    a = await wide.generate(PROMPTS, greedy(8))
    b = await narrow.generate(PROMPTS, greedy(8))
    assert [g.response_ids for g in a] == [g.response_ids for g in b]


async def decoding_interruptibly(tiny_dir: Path) -> tuple[HFEngine, asyncio.Task[list[Generation]]]:
    """An interruptible engine, and a long generation (200 tokens) it has started decoding."""
    engine = HFEngine.from_pretrained(tiny_dir, max_batch_size=16, interruptible=True)
    task = asyncio.create_task(
        engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=200, seed=0))
    )
    await wait_until(lambda: engine._generating, what="the decode loop to run")
    return engine, task


async def test_interruptible_engine_swaps_weights_between_tokens(
    tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    engine, task = await decoding_interruptibly(tiny_dir)
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
    after = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=1))
    assert all(g.version == 1 and close(g, reference_models[1]) for g in after)


async def test_a_recorded_decode_regenerates_bit_for_bit_with_its_switches(
    tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    """``regenerate`` decodes a call again as it ran (``relax replay --regenerate``): the same
    chunks, each token on the weights version recorded for it, switching where the original
    did; one version switched one token later already changes the logprobs."""
    engine = HFEngine.from_pretrained(tiny_dir, max_batch_size=4, interruptible=True)
    prompts, seeds = PROMPTS * 3, [11, 12, 13, 14, 15, 16][: len(PROMPTS) * 3]
    params = SamplingParams(max_new_tokens=120, n=2)
    task = asyncio.create_task(engine.generate(prompts, params, seeds=seeds))
    await wait_until(lambda: engine._generating, what="the decode loop to run")
    await engine.load_weights(1, reference_models[1].state_dict())
    gens = await task
    schedules = chunk_schedules(gens, engine.max_batch_size)
    assert len(schedules) == -(-len(gens) // 4) and {0, 1} <= set(schedules[0])
    weights = {v: m.state_dict() for v, m in reference_models.items()}

    again = HFEngine.from_pretrained(tiny_dir, max_batch_size=4)  # not interruptible: no matter
    regenerated = again.regenerate(prompts, params, seeds, schedules, weights.__getitem__)
    assert [(g.response_ids, g.logprobs, g.token_versions) for g in regenerated] == [
        (g.response_ids, g.logprobs, g.token_versions) for g in gens
    ]
    # Only the first chunk, its switch one token later: its rows differ from there on.
    late = list(schedules[0])
    at = late.index(1)
    late[at] = 0
    only_first = [late] + [None] * (len(schedules) - 1)
    moved = again.regenerate(prompts, params, seeds, only_first, weights.__getitem__)
    assert moved[4:] == [None] * (len(gens) - 4)
    for old, new in zip(gens[:4], moved[:4], strict=True):
        assert new.logprobs[:at] == old.logprobs[:at] and new.logprobs[at] != old.logprobs[at]


async def test_interruptible_engine_refuses_a_bad_update_mid_generation(
    tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    engine, task = await decoding_interruptibly(tiny_dir)
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


def test_per_row_draws_follow_each_rows_distribution() -> None:
    from relax.engines._hf import _draw_per_row

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]])
    generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
    draws = torch.stack([_draw_per_row(probs, generators) for _ in range(20_000)])
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6).double() / len(draws)
        assert counts[probs[row] == 0].sum() == 0  # a token of probability 0 is never drawn
        assert torch.allclose(counts, probs[row].double(), atol=0.015), counts
    # A row draws from its own generator alone: the same tokens without the other row.
    again = torch.Generator().manual_seed(2)
    alone = torch.stack([_draw_per_row(probs[1:], [again]) for _ in range(20_000)])
    assert torch.equal(alone[:, 0], draws[:, 1])


def test_an_inverse_cdf_draw_at_the_very_end_stays_on_a_drawable_token() -> None:
    from relax.engines._hf import _inverse_cdf

    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # u = 1 (a uniform rounded up to the row's total) would fall past the last token.
    assert _inverse_cdf(probs, torch.ones(3, dtype=torch.float64)).tolist() == [1, 2, 0]
    assert _inverse_cdf(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [0, 0, 0]
    assert _inverse_cdf(probs, torch.full((3,), 0.3, dtype=torch.float64)).tolist() == [1, 0, 0]
