"""The contract every ``GenerationEngine`` keeps, as one suite both engines run.

``EngineContract`` holds the tests; a test module subclasses it (``class TestHFContract``) and
provides three fixtures: ``engine`` (serves the version-0 weights and is never changed),
``swap`` (a ``Swap`` over an engine whose weights the tests change) and ``reference_models``
(independent HF copies of the two weight sets: ``{0: ..., 1: ...}``). The tests are written
relative to the swap engine's version, so a module may share that engine between tests.

Logprob tolerance ``ATOL``: engines and the HF reference compute in float32, with different
kernels; see ``test_vllm_engine``'s docstring for why ``1e-4`` separates rounding from any
semantic error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from relax.engines import EngineError, Generation, GenerationEngine, SamplingParams

PROMPTS = [
    [257, 104, 105],
    [257, 50, 43, 50, 61, 32, 119, 104, 97, 116, 63],
]  # ragged: left padding

ATOL = 1e-4

References = dict[int, torch.nn.Module]


class Swap:
    """An engine whose weights the tests change, and which reference model it serves."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine, self.serving = engine, 0

    async def load_next(self, reference_models: References) -> int:
        """Load the other weight set as the next version; returns the reference index."""
        other = 1 - self.serving
        await self.engine.load_weights(
            self.engine.version + 1, reference_models[other].state_dict()
        )
        self.serving = other
        return other


def recompute(model: torch.nn.Module, gen: Generation, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at each generated position, from one unpadded forward pass."""
    ids = torch.tensor([gen.prompt_ids + gen.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(gen.prompt_ids) - 1 : -1].float() / temperature
    return (
        logits.log_softmax(-1).gather(-1, torch.tensor(gen.response_ids).unsqueeze(-1)).squeeze(-1)
    )


def close(gen: Generation, model: torch.nn.Module, temperature: float = 1.0) -> bool:
    return torch.allclose(torch.tensor(gen.logprobs), recompute(model, gen, temperature), atol=ATOL)


def greedy(max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> SamplingParams:
    """Greedy decoding (deterministic) of at most ``max_new_tokens``."""
    return SamplingParams(max_new_tokens, temperature=0, stop_token_ids=tuple(stop_token_ids))


class EngineContract:
    """The tests (see the module docstring); subclass as ``Test...`` to run them."""

    # ------------------------------------------------------------------ generation

    async def test_stop_token_ends_the_response(self, engine: GenerationEngine) -> None:
        # Greedy decoding is deterministic: take its 3rd token as the stop token.
        free = await engine.generate(PROMPTS[:1], greedy(8))
        stop = free[0].response_ids[2]
        first = free[0].response_ids.index(stop)
        stopped = await engine.generate(PROMPTS, greedy(8, stop_token_ids=[stop]))
        assert stopped[0].finish_reason == "stop"
        assert stopped[0].response_ids == free[0].response_ids[: first + 1]  # stop token kept
        assert len(stopped[0].logprobs) == first + 1
        other = stopped[1]
        assert (other.finish_reason == "stop") == (stop in other.response_ids)
        assert stop not in other.response_ids[:-1]  # nothing after a stop, padding included
        if other.finish_reason == "length":
            assert len(other.response_ids) == 8

    async def test_every_finished_sequence_is_reported_once_before_the_call_returns(
        self, engine: GenerationEngine
    ) -> None:
        # Stop on half the vocabulary: the samples end after different numbers of tokens.
        params = SamplingParams(
            max_new_tokens=12, n=3, stop_token_ids=tuple(range(0, engine.vocab_size, 2))
        )
        heard: dict[int, Generation] = {}

        def finished(sequence: int, gen: Generation) -> None:
            assert sequence not in heard
            heard[sequence] = gen

        gens = await engine.generate(PROMPTS, params, seeds=[1, 2], on_finished=finished)
        assert sorted(heard) == list(range(len(gens)))
        assert all(heard[i] == gen for i, gen in enumerate(gens))  # the very generations
        assert len({len(g.response_ids) for g in gens}) > 1  # the lengths did differ

    async def test_a_sequence_is_reported_the_moment_it_ends_not_with_its_batch(
        self, engine: GenerationEngine
    ) -> None:
        """``on_finished`` and ``on_token`` reach the loop in the order the decode loop produced
        them: when a sequence is reported, exactly as many decode steps were heard as it has
        tokens — the shortest come out first, while the longest still decode."""
        params = SamplingParams(max_new_tokens=16, n=4, stop_token_ids=tuple(range(0, 512, 3)))
        steps = 0
        order: list[tuple[int, int]] = []  # (steps heard, tokens) at each report

        def on_token(events: list) -> None:
            nonlocal steps
            steps += 1

        def finished(sequence: int, gen: Generation) -> None:
            order.append((steps, len(gen.response_ids)))

        gens = await engine.generate(
            PROMPTS, params, seeds=[3, 4], on_token=on_token, on_finished=finished
        )
        ended = [(len(g.response_ids), g.finish_reason) for g in gens]
        assert len(order) == len(gens) and len({n for n, _ in ended}) > 2
        stopped = [(heard, n) for heard, n in order if heard < steps]
        assert stopped and all(heard == n for heard, n in stopped)  # reported at its own end
        assert [n for _, n in order] == sorted(n for n, _ in ended)  # shortest first
        assert engine.finishes_early

    @pytest.mark.parametrize(("temperature", "n"), [(1.0, 1), (0.7, 2), (1.5, 1), (0.0, 1)])
    async def test_logprobs_equal_a_recomputation(
        self,
        engine: GenerationEngine,
        reference_models: References,
        temperature: float,
        n: int,
    ) -> None:
        params = SamplingParams(max_new_tokens=12, temperature=temperature, n=n, seed=3)
        gens = await engine.generate(PROMPTS, params)
        for gen in gens:
            assert close(gen, reference_models[0], temperature or 1.0)  # greedy reports T = 1
            if temperature not in (0.0, 1.0):  # the sampled-from distribution, not the raw one
                assert not close(gen, reference_models[0], 1.0)

    async def test_logprobs_are_under_truncation_when_top_k_is_set(
        self, engine: GenerationEngine, reference_models: References
    ) -> None:
        # With top-k the reported distribution is the renormalised top-k one: never below plain.
        gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=5, seed=0))
        for gen in gens:
            plain = recompute(reference_models[0], gen)
            assert (torch.tensor(gen.logprobs) > plain + 1e-3).all()
            # Exactly the renormalised top-5 distribution.
            ids = torch.tensor([gen.prompt_ids + gen.response_ids])
            with torch.no_grad():
                logits = reference_models[0](ids).logits[0, len(gen.prompt_ids) - 1 : -1]
            kth = logits.topk(5, -1).values[:, -1:]
            truncated = logits.masked_fill(logits < kth, -torch.inf).log_softmax(-1)
            want = truncated.gather(-1, torch.tensor(gen.response_ids)[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(gen.logprobs), want, atol=ATOL)

    async def test_same_seed_same_output(self, engine: GenerationEngine) -> None:
        params = SamplingParams(max_new_tokens=10, temperature=1.0, n=2)
        a = await engine.generate(PROMPTS, replace(params, seed=11))
        b = await engine.generate(PROMPTS, replace(params, seed=11))
        c = await engine.generate(PROMPTS, replace(params, seed=12))
        assert [g.response_ids for g in a] == [g.response_ids for g in b]
        assert [g.logprobs for g in a] == [g.logprobs for g in b]
        assert [g.response_ids for g in a] != [g.response_ids for g in c]
        # One seed for the call still gives a repeated prompt its own samples (vLLM's noise
        # depends on the seed only, so equal per-request seeds would draw equal tokens).
        twice = await engine.generate(
            [PROMPTS[0], PROMPTS[0]], SamplingParams(max_new_tokens=10, seed=11)
        )
        assert twice[0].response_ids != twice[1].response_ids

    async def test_per_prompt_seeds_do_not_depend_on_the_batch(
        self, engine: GenerationEngine
    ) -> None:
        params = SamplingParams(max_new_tokens=10, n=3)
        both = await engine.generate(PROMPTS, params, seeds=[5, 6])
        alone = await engine.generate(PROMPTS[1:], params, seeds=[6])
        other = await engine.generate(PROMPTS[1:], params, seeds=[7])
        assert [g.response_ids for g in both[3:]] == [g.response_ids for g in alone]
        assert [g.response_ids for g in alone] != [g.response_ids for g in other]
        # The samples of one prompt differ from each other (each row has its own generator).
        assert len({tuple(g.response_ids) for g in alone}) > 1
        with pytest.raises(EngineError, match="2 seeds for 1 prompts"):
            await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), seeds=[1, 2])

    async def test_event_loop_keeps_serving_during_generation(
        self, engine: GenerationEngine
    ) -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=32, seed=0))
        task.cancel()
        assert ticks > 3

    async def test_bad_requests(self, engine: GenerationEngine) -> None:
        with pytest.raises(EngineError, match="empty"):
            await engine.generate([[]], SamplingParams(max_new_tokens=4))
        with pytest.raises(EngineError, match="outside"):
            await engine.generate([[512]], SamplingParams(max_new_tokens=4))
        with pytest.raises(EngineError, match="top_p"):
            await engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, top_p=0))
        with pytest.raises(EngineError, match="positions"):
            await engine.generate(PROMPTS, SamplingParams(max_new_tokens=2000))
        assert await engine.generate([], SamplingParams(max_new_tokens=4)) == []

    # ------------------------------------------------------------------ weights

    async def test_load_weights_changes_outputs_and_version(
        self, swap: Swap, reference_models: References
    ) -> None:
        engine = swap.engine
        before = await engine.generate(PROMPTS, greedy(8))
        loads, version = engine.statistics()["weight_loads"], engine.version
        now = await swap.load_next(reference_models)
        assert engine.version == version + 1
        assert engine.statistics()["weight_loads"] == loads + 1
        after = await engine.generate(PROMPTS, greedy(8))
        assert [g.response_ids for g in before] != [g.response_ids for g in after]
        assert all(g.version == version + 1 and close(g, reference_models[now]) for g in after)

    async def test_bad_weight_updates_change_nothing(
        self, swap: Swap, reference_models: References
    ) -> None:
        engine = swap.engine
        version, serving = engine.version, swap.serving
        before = await engine.generate(PROMPTS, greedy(6))
        weights = {k: v.clone() for k, v in reference_models[1 - serving].state_dict().items()}
        name = next(iter(weights))
        with pytest.raises(EngineError, match="shape"):
            await engine.load_weights(version + 1, {**weights, name: torch.zeros(3, 3)})
        with pytest.raises(EngineError, match="unknown weight"):
            await engine.load_weights(version + 1, {**weights, "nope.weight": torch.zeros(1)})
        with pytest.raises(EngineError, match="missing"):
            await engine.load_weights(version + 1, dict(list(weights.items())[:3]))
        with pytest.raises(EngineError, match="older"):
            await engine.load_weights(version - 1, weights)
        assert engine.version == version
        after = await engine.generate(PROMPTS, greedy(6))
        assert [g.response_ids for g in after] == [g.response_ids for g in before]
        assert all(close(g, reference_models[serving]) for g in after)  # the old weights, whole
        await engine.load_weights(version + 2, list(weights.items()))  # (name, tensor) pairs work
        swap.serving = 1 - serving
        assert engine.version == version + 2
        with pytest.raises(EngineError, match="older"):
            await engine.load_weights(version + 1, weights)
        await engine.load_weights(version + 2, weights)  # the same version again is allowed
        assert engine.version == version + 2

    async def test_concurrent_generation_and_weight_load_never_mix(
        self, swap: Swap, reference_models: References
    ) -> None:
        engine = swap.engine
        version, old, new = engine.version, swap.serving, 1 - swap.serving
        new_weights = {k: v.clone() for k, v in reference_models[new].state_dict().items()}
        params = SamplingParams(max_new_tokens=24, seed=0)
        first = asyncio.create_task(engine.generate(PROMPTS * 4, params))
        await asyncio.sleep(0)  # let it take the engine
        load = asyncio.create_task(engine.load_weights(version + 1, new_weights))
        second = asyncio.create_task(engine.generate(PROMPTS * 4, params))
        gens_first, _, gens_second = await asyncio.gather(first, load, second)
        swap.serving = new
        assert {g.version for g in gens_first} == {version}
        assert {g.version for g in gens_second} == {version + 1}
        for gen, ref in [(g, old) for g in gens_first] + [(g, new) for g in gens_second]:
            # The reported version's weights explain every logprob; the other version's do not.
            assert close(gen, reference_models[ref]) and not close(gen, reference_models[1 - ref])

    async def test_cancelled_generation_still_never_overlaps_a_load(
        self, swap: Swap, reference_models: References
    ) -> None:
        # A cancelled caller stops waiting while a worker thread still decodes its call (HF to
        # the end; vLLM's step loop aborts it at the next step): the weight swap must still
        # wait for that thread, never land inside a forward pass.
        engine = swap.engine
        requests = engine.statistics()["requests"]
        task = asyncio.create_task(
            engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=64, seed=0))
        )
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        now = await swap.load_next(reference_models)
        assert engine.statistics()["requests"] == requests + 1  # the abandoned call was taken
        gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=1))
        assert all(g.version == engine.version and close(g, reference_models[now]) for g in gens)
