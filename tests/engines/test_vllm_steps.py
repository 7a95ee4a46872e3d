"""The vLLM engine's step loop (``relax.engines._vllm_loop``): a call that arrives while another
decodes starts at once (continuous batching), and an interruptible engine lands a weight
update between two steps — every running request resumed from its own prefix under the new
weights, every token's version recorded, and the interrupted call regenerated segment by
segment (``relax replay --regenerate``). Same tiny model and tolerances as
``test_vllm_engine``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from relax.engines import EngineError, Generation, SamplingParams
from relax.engines._vllm import VLLMEngine
from relax.replay._generations import version_runs
from tests.engines.contract import ATOL, PROMPTS, recompute
from tests.engines.test_vllm_engine import TINY, needs_vllm

pytestmark = [pytest.mark.anyio, pytest.mark.slow, needs_vllm]

__all__ = ["TINY"]  # the shapes conftest's tiny_dir builds


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def serving(tiny_dir: Path, interruptible: bool = False) -> AsyncIterator[VLLMEngine]:
    """A vLLM engine of its own for one test (weights get swapped), closed after it."""
    engine = VLLMEngine.from_pretrained(tiny_dir, interruptible=interruptible)
    try:
        yield engine
    finally:
        await engine.close()


async def decoding(
    engine: VLLMEngine, params: SamplingParams, seeds: list[int] | None = None
) -> asyncio.Task[list[Generation]]:
    """A generation of ``PROMPTS`` ``engine`` has begun decoding (its first tokens are out)."""
    first = asyncio.Event()
    task = asyncio.create_task(
        engine.generate(PROMPTS, params, seeds=seeds, on_token=lambda events: first.set())
    )
    started = asyncio.create_task(first.wait())
    await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    if task.done():
        task.result()  # it failed before decoding: raise that here, not hang
    return task


def explained_by(gen: Generation, models: dict[int, torch.nn.Module]) -> bool:
    """Each token's logprob is its version's, recomputed on the whole prefix (vLLM recomputes
    a resumed request's prefix under the new weights)."""
    versions = torch.tensor(gen.token_versions)
    want = torch.zeros(len(gen.response_ids))
    for version, model in models.items():
        want = torch.where(versions == version, recompute(model, gen), want)
    return torch.allclose(torch.tensor(gen.logprobs), want, atol=ATOL)


async def test_a_call_arriving_mid_decode_starts_at_once(tiny_dir: Path) -> None:
    async with serving(tiny_dir) as engine:
        long = await decoding(engine, SamplingParams(max_new_tokens=300, seed=0))
        short = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))
        assert not long.done()  # the short call did not wait for the long one to end
        assert all(len(g.response_ids) == 4 for g in short)
        assert all(len(g.response_ids) == 300 for g in await long)


async def test_an_update_lands_mid_call_and_the_call_regenerates(
    tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    async with serving(tiny_dir, interruptible=True) as engine:
        params, seeds = SamplingParams(max_new_tokens=300, n=2), [5, 6]
        task = await decoding(engine, params, seeds)
        await engine.load_weights(1, reference_models[1].state_dict())
        assert engine.version == 1 and not task.done()  # landed while the call still ran
        gens = await task
        stats = engine.statistics()
        assert stats["interrupted_loads"] == 1 and stats["resumed_sequences"] == len(gens)
        for gen in gens:
            versions = gen.token_versions
            assert versions is not None and len(versions) == len(gen.response_ids) == 300
            switch = versions.index(1)
            assert switch > 0 and versions == [0] * switch + [1] * (300 - switch)
            assert gen.version == 0  # judged by its oldest token
            assert explained_by(gen, reference_models)
        # The next call runs on the new weights only.
        after = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=2))
        assert all(set(g.token_versions or []) == {1} for g in after)

        # Decoded again segment by segment, each resumed as the step loop resumed it.
        weights = {v: m.state_dict() for v, m in reference_models.items()}
        schedule = max((g.token_versions for g in gens), key=len)
        again = await asyncio.to_thread(
            engine.regenerate,
            PROMPTS,
            params,
            seeds,
            [schedule],
            weights.__getitem__,
            runs=[[tuple(r) for r in version_runs(g)] for g in gens],
        )
        assert [(g.response_ids, g.logprobs, g.token_versions) for g in again] == [
            (g.response_ids, g.logprobs, g.token_versions) for g in gens
        ]
        with pytest.raises(EngineError, match="needs each generation's version runs"):
            engine.regenerate(PROMPTS, params, seeds, [schedule], weights.__getitem__)


async def test_penalised_requests_and_bad_updates_are_never_interrupted(
    tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    async with serving(tiny_dir, interruptible=True) as engine:
        # A bad update is refused before anything running is touched.
        task = await decoding(engine, SamplingParams(max_new_tokens=300, seed=0))
        bad = {k: v[..., :1].clone() for k, v in reference_models[1].state_dict().items()}
        with pytest.raises(EngineError, match="weight update refused"):
            await engine.load_weights(1, bad)
        gens = await task
        assert engine.version == 0 and engine.statistics()["resumed_sequences"] == 0
        assert all(set(g.token_versions or []) == {0} for g in gens)

        # Presence/frequency penalties count the response's tokens: resuming would turn them
        # into prompt tokens, so the update waits for the penalised call to end.
        penalised = SamplingParams(max_new_tokens=300, seed=0, presence_penalty=0.5)
        task = await decoding(engine, penalised)
        await engine.load_weights(1, reference_models[1].state_dict())
        assert task.done()
        assert all(set(g.token_versions or []) == {0} for g in task.result())
        assert engine.statistics()["resumed_sequences"] == 0


async def test_an_abandoned_call_is_aborted(tiny_dir: Path) -> None:
    async with serving(tiny_dir) as engine:
        task = await decoding(engine, SamplingParams(max_new_tokens=1000, seed=0))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Its requests leave at the next step: once a 3-token call is served, nothing of the
        # 1,000-token one still runs.
        gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=1))
        assert all(len(g.response_ids) == 3 for g in gens)
        assert not engine._loop._running
