"""LoRA on the HF engine: every published adapter reaches it, and it computes what the trainer
computes.

Users of other engines report adapters that silently never reach the rollout (the engine keeps
sampling from the base model while the version number moves on). Here each version goes the
real way — the trainer's ``state_dict_for_publish``, the bus's weights channel, the engine's
``load_weights`` — and after each publish the engine's log-probabilities must (a) differ from
the previous version's for the same prompt and (b) equal the trainer's own recomputation for
the same tokens, within the engines' ``ATOL``. A rollout that joins late gets the newest
adapter from the bus. A load of the wrong kind (full weights into a LoRA engine, an adapter
into a full-weights one, another rank) is refused and changes nothing.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from relax.actors import ChildSpec, Supervisor
from relax.bus import BusClient, BusService
from relax.config import AlgorithmConfig, LoraConfig, ModelInitConfig, TrainerConfig
from relax.engines import EngineError, Generation, HFEngine, SamplingParams
from relax.models import (
    adapter_state_dict,
    apply_lora,
    build_tiny_model,
    is_adapter_name,
    load_policy,
)
from relax.training import make_backend, pack_batch, response_values, sequence_logprobs
from tests.actors.helpers import wait_until
from tests.engines.contract import ATOL, PROMPTS, recompute

pytest.importorskip("peft")
pytestmark = pytest.mark.anyio

LORA = LoraConfig(rank=4, alpha=8.0)
PROBE = SamplingParams(max_new_tokens=4, seed=7, top_logprobs=8)
"""Seeded sampling with the first step's top-8 log-probabilities: one fixed prompt's first
token distribution is compared across versions."""
_names = itertools.count()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory):
    init = ModelInitConfig(vocab_size=261, hidden_size=64, num_heads=4, num_kv_heads=2)
    return build_tiny_model(init, tmp_path_factory.mktemp("lora_base"))


def _trainer(base_dir):
    model, _ = load_policy(base_dir)
    trainer = TrainerConfig(lr=0.05, micro_batch_size=8, global_batch_size=8)
    return make_backend(trainer, AlgorithmConfig(), model, 0, 1.0, lora=LORA)


def _rows(gens: list[Generation]) -> list[dict]:
    """Scored rows of the engine's own samples: within each prompt's group, every other one
    is rewarded (GRPO advantages of +-1, so every step moves the adapter)."""
    return [
        {
            "prompt_ids": g.prompt_ids,
            "response_ids": g.response_ids,
            "logprobs": g.logprobs,
            "reward": float(g.index % 2),
            "group": str(g.prompt_ids),
        }
        for g in gens
    ]


def _trainer_logprobs(backend, gens: list[Generation]) -> list[list[float]]:
    batch = pack_batch(_rows(gens), 0)
    with torch.no_grad():
        return response_values(batch, sequence_logprobs(backend.model, batch))


def _first_step(gens: list[Generation]) -> torch.Tensor:
    """The first token's top-8 log-probabilities of each probe (same prompts every version)."""
    assert all(g.top_logprobs for g in gens)
    return torch.tensor([[v for _, v in g.top_logprobs[0]] for g in gens])


async def _bus(tmp_path) -> tuple[Supervisor, str]:
    url = f"inproc://lora-bus-{next(_names)}"
    kwargs = {"url": url, "run_dir": str(tmp_path), "staleness": "inf"}
    sup = Supervisor([ChildSpec("bus", BusService, kwargs=kwargs)])
    await sup.__aenter__()
    return sup, await sup.ref("bus").call("address")


@pytest.mark.slow
async def test_each_published_adapter_reaches_the_engine_and_matches_the_trainer(
    tmp_path, base_dir
) -> None:
    backend = _trainer(base_dir)
    engine = HFEngine.from_pretrained(base_dir, lora=LORA)
    sup, url = await _bus(tmp_path)
    try:
        async with (
            await BusClient.connect(url) as trainer_bus,
            await BusClient.connect(url) as rollout_bus,
        ):
            previous = _first_step(await engine.generate(PROMPTS, PROBE))
            for version in (1, 2, 3):
                samples = SamplingParams(max_new_tokens=4, n=4, seed=version)
                assert backend.step(_rows(await engine.generate(PROMPTS, samples))).applied
                published = backend.state_dict_for_publish()
                assert published and all(is_adapter_name(name) for name in published)
                await trainer_bus.publish_weights(backend.version, published)

                got = await rollout_bus.poll_weights(after=engine.version, wait=5)
                assert got is not None and got[0] == version
                await engine.load_weights(*got)
                assert engine.version == version

                probes = await engine.generate(PROMPTS, PROBE)
                now = _first_step(probes)
                # (a) the adapter changed what the engine computes...
                assert (now - previous).abs().max().item() > 1e-3, version
                previous = now
                # (b) ...into exactly what the trainer computes for the same tokens.
                for gen, want in zip(probes, _trainer_logprobs(backend, probes), strict=True):
                    assert torch.allclose(torch.tensor(gen.logprobs), torch.tensor(want), atol=ATOL)

            # A rollout that starts now gets the newest adapter from the bus and samples what
            # the first one does.
            late = HFEngine.from_pretrained(base_dir, lora=LORA)
            got = await rollout_bus.poll_weights(after=late.version, wait=5)
            assert got is not None and got[0] == 3
            await late.load_weights(*got)
            late_probes = await late.generate(PROMPTS, PROBE)
            assert [g.response_ids for g in late_probes] == [g.response_ids for g in probes]
            assert [g.logprobs for g in late_probes] == [g.logprobs for g in probes]
    finally:
        await sup.__aexit__(None, None, None)


async def test_a_load_of_the_wrong_kind_is_refused_and_changes_nothing(base_dir) -> None:
    engine = HFEngine.from_pretrained(base_dir, lora=LORA)
    before = await engine.generate(PROMPTS, PROBE)
    full, _ = load_policy(base_dir)
    with pytest.raises(EngineError, match="full weights cannot replace a LoRA adapter"):
        await engine.load_weights(1, full.state_dict())

    bigger = adapter_state_dict(
        apply_lora(load_policy(base_dir)[0], LORA.model_copy(update={"rank": 8}))
    )
    with pytest.raises(EngineError, match="shape"):
        await engine.load_weights(1, bigger)
    partial = dict(list(adapter_state_dict(engine.model).items())[:3])
    with pytest.raises(EngineError, match="missing"):
        await engine.load_weights(1, partial)
    assert engine.version == 0
    after = await engine.generate(PROMPTS, PROBE)
    assert [g.logprobs for g in after] == [g.logprobs for g in before]

    plain = HFEngine.from_pretrained(base_dir)
    with pytest.raises(EngineError, match="LoRA adapter tensors"):
        await plain.load_weights(1, adapter_state_dict(engine.model))
    assert plain.version == 0


@pytest.mark.slow
async def test_an_interruptible_engine_swaps_adapters_between_two_tokens(base_dir) -> None:
    """The swap a partial rollout needs: an adapter offered mid-generation lands between two
    tokens; the tokens before it are the old version's, the ones after it the new one's."""
    backend = _trainer(base_dir)
    engine = HFEngine.from_pretrained(base_dir, lora=LORA, interruptible=True, max_batch_size=16)
    samples = SamplingParams(max_new_tokens=4, n=4, seed=1)
    assert backend.step(_rows(await engine.generate(PROMPTS, samples))).applied
    task = asyncio.create_task(
        engine.generate(PROMPTS * 8, SamplingParams(max_new_tokens=200, seed=0))
    )
    await wait_until(lambda: engine._generating, what="the decode loop to run")
    await engine.load_weights(1, backend.state_dict_for_publish())
    gens = await task
    assert engine.statistics()["interrupted_loads"] == 1
    for gen in gens:
        versions = gen.token_versions
        assert versions is not None and versions.index(1) > 0
        switch = versions.index(1)
        assert versions == [0] * switch + [1] * (len(versions) - switch)
    # Before the switch: version 0, the fresh adapter (an identity update), i.e. the base model.
    # (After it, keys/values of the prefix still come from the old adapter's cache, as in any
    # partial rollout: no recomputation reproduces those tokens; the test above checks loads.)
    base, _ = load_policy(base_dir)
    for gen in gens[:2]:
        switch = gen.token_versions.index(1)
        old = recompute(base, gen)[:switch]
        assert torch.allclose(torch.tensor(gen.logprobs[:switch]), old, atol=ATOL)
