"""HFEngine's decode batch compaction: finished rows leave the forward passes (and their KV
cache rows), and nothing a caller sees changes — tokens, finish reasons, streamed events,
seeded draws — except the time it takes."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from relax.config import ModelInitConfig
from relax.engines import Generation, HFEngine, SamplingParams, TokenEvent
from relax.models import build_tiny_model, load_policy, load_tokenizer
from relax.replay import chunk_schedules
from tests.actors.helpers import wait_until
from tests.tiny import spread_lengths

pytestmark = pytest.mark.anyio

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
MAX_NEW = 48


@pytest.fixture(scope="module")
def spread_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny policy whose responses stop at widely spread lengths (1 token to the cap)."""
    init = ModelInitConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return spread_lengths(build_tiny_model(init, tmp_path_factory.mktemp("spread")))


class PassSizes:
    """The batch size of every forward pass of ``engine``'s model (the prefill first)."""

    def __init__(self, engine: HFEngine) -> None:
        self.sizes: list[int] = []
        engine.model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.sizes.append(int(kwargs["input_ids"].shape[0]))


def engines(model_dir: Path, **kwargs: Any) -> tuple[HFEngine, HFEngine]:
    """The same weights twice: compacting (the default) and keeping every row to the end."""
    return (
        HFEngine.from_pretrained(model_dir, **kwargs),
        HFEngine.from_pretrained(model_dir, compact=False, **kwargs),
    )


def assert_same(compacted: list[Generation], full: list[Generation]) -> None:
    """The same tokens and outcomes; logprobs within float noise (a row's last bits depend
    on the size of the batch it is computed in)."""
    assert [g.response_ids for g in compacted] == [g.response_ids for g in full]
    assert [g.finish_reason for g in compacted] == [g.finish_reason for g in full]
    assert [g.token_versions for g in compacted] == [g.token_versions for g in full]
    for a, b in zip(compacted, full, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        if b.top_logprobs is not None:
            assert a.top_logprobs is not None
            for got, want in zip(a.top_logprobs, b.top_logprobs, strict=True):
                assert [i for i, _ in got] == [i for i, _ in want]
                assert all(
                    math.isclose(x, y, abs_tol=1e-5)
                    for (_, x), (_, y) in zip(got, want, strict=True)
                )


SAMPLINGS = {
    "one seed for the call": ({"seed": 3}, None),
    "a seed per prompt": ({}, [21, 22, 23, 24]),
    "penalties and top logprobs": (
        {"seed": 4, "presence_penalty": 0.5, "frequency_penalty": 0.3, "top_logprobs": 3},
        None,
    ),
    "greedy": ({"temperature": 0.0}, None),
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
async def test_finished_rows_leave_the_batch_and_no_token_changes(
    spread_dir: Path, sampling: str
) -> None:
    extra, seeds = SAMPLINGS[sampling]
    stop = load_tokenizer(spread_dir).eos_token_id
    params = SamplingParams(max_new_tokens=MAX_NEW, n=8, stop_token_ids=[stop], **extra)
    compacting, keeping = engines(spread_dir, max_batch_size=32)
    passes, full_passes = PassSizes(compacting), PassSizes(keeping)
    compacted = await compacting.generate(PROMPTS, params, seeds=seeds)
    full = await keeping.generate(PROMPTS, params, seeds=seeds)
    assert_same(compacted, full)

    lengths = sorted(len(g.response_ids) for g in full)
    if sampling != "greedy":  # the policy spreads: the premise of everything below
        assert lengths[0] <= 4 and lengths[-1] >= 3 * lengths[len(lengths) // 4]
    assert set(full_passes.sizes) == {32}  # every row in every pass, to the longest
    assert passes.sizes[0] == 32 and len(passes.sizes) == len(full_passes.sizes)
    assert passes.sizes == sorted(passes.sizes, reverse=True)
    # A pass carries at most 4/3 of the rows still generating (a quarter of it finished
    # makes it shrink), and at least those.
    for step, size in enumerate(passes.sizes[1:], start=1):
        generating = sum(len(g.response_ids) > step for g in full)
        assert generating <= size <= max(generating * 4 // 3, generating + 1)
    if sampling != "greedy":
        assert sum(passes.sizes) < 0.75 * sum(full_passes.sizes)


async def test_streamed_tokens_and_finished_rows_are_the_same(spread_dir: Path) -> None:
    stop = load_tokenizer(spread_dir).eos_token_id
    params = SamplingParams(max_new_tokens=MAX_NEW, n=4, seed=9, stop_token_ids=[stop])
    heard: dict[bool, tuple[list[TokenEvent], list[tuple[int, list[int]]]]] = {}
    for engine in engines(spread_dir):
        events: list[TokenEvent] = []
        ended: list[tuple[int, list[int]]] = []
        await engine.generate(
            PROMPTS,
            params,
            on_token=events.extend,
            on_finished=lambda i, g, ended=ended: ended.append((i, g.response_ids)),
        )
        heard[engine.compact] = (events, ended)
    (events, ended), (full_events, full_ended) = heard[True], heard[False]
    assert [(e.sequence, e.token_id) for e in events] == [
        (e.sequence, e.token_id) for e in full_events
    ]
    assert ended == full_ended  # each row reported as it ended, in the same order


async def test_a_compacted_interrupted_decode_regenerates_bit_for_bit(
    spread_dir: Path, tmp_path: Path
) -> None:
    """``relax replay --regenerate`` decodes a call again as it ran: rows leave the batch at
    the same tokens, weights switch at the same tokens — the same bits."""
    other = build_tiny_model(
        ModelInitConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=1),
        tmp_path / "other",
    )
    weights = {0: load_policy(spread_dir)[0].state_dict(), 1: load_policy(other)[0].state_dict()}
    stop = load_tokenizer(spread_dir).eos_token_id
    engine = HFEngine.from_pretrained(spread_dir, max_batch_size=16, interruptible=True)
    passes = PassSizes(engine)
    prompts, seeds = PROMPTS, [31, 32, 33, 34]
    params = SamplingParams(max_new_tokens=400, n=4, stop_token_ids=[stop])
    task = asyncio.create_task(engine.generate(prompts, params, seeds=seeds))
    # Switch once some rows have left the batch, while others still generate.
    await wait_until(lambda: any(s < 16 for s in passes.sizes), what="rows to leave the batch")
    await engine.load_weights(1, weights[1])
    gens = await task
    assert any(1 in (g.token_versions or []) for g in gens), "the switch landed mid-call"

    again = HFEngine.from_pretrained(spread_dir, max_batch_size=16)
    again_passes = PassSizes(again)
    schedules = chunk_schedules(gens, again.max_batch_size)
    regenerated = again.regenerate(prompts, params, seeds, schedules, weights.__getitem__)
    assert [(g.response_ids, g.logprobs, g.token_versions) for g in regenerated] == [
        (g.response_ids, g.logprobs, g.token_versions) for g in gens
    ]
    assert again_passes.sizes == passes.sizes
