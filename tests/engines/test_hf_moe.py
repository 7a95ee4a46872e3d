"""The HF engine on a mixture-of-experts policy records, for every token of prompt and
response, the experts its routers chose (what R3 replays), aligned through left padding,
several batches, stop strings and interruptible weight updates."""

from __future__ import annotations

import pytest
import torch

from relax.config import ModelInitConfig
from relax.engines import HFEngine, SamplingParams
from relax.models import RoutingRecorder, build_tiny_model

pytestmark = pytest.mark.anyio
INIT = ModelInitConfig(arch="qwen3_moe", vocab_size=261, num_experts=8, seed=5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(INIT, tmp_path_factory.mktemp("moe"))


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 43, 44]]


async def test_each_token_s_routing_is_what_the_engine_s_routers_chose(folder) -> None:
    engine = HFEngine.from_pretrained(folder, max_batch_size=4)  # two batches of the six
    seen: list[torch.Tensor] = []  # every router call during generation, by a hook of ours
    hooks = [
        r.register_forward_hook(lambda m, a, out: seen.append(out[2].clone()))
        for r in RoutingRecorder(engine.model).routers
    ]
    gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, n=2, seed=3))
    for hook in hooks:
        hook.remove()
    assert seen, "the routers ran"
    for gen in gens:
        routed = gen.routed_experts
        tokens = len(gen.prompt_ids) + len(gen.response_ids)
        assert routed.dtype == torch.uint8 and tuple(routed.shape) == (tokens, 2, 2)
        assert (routed[-1] == 8).all()  # the last token is never fed back: not recorded
        assert (routed[:-1] < 8).all()
        # The same as the routers choose for these tokens in one teacher-forced pass (the
        # padding and the KV cache did not move any token's routing).
        with RoutingRecorder(engine.model) as rec, torch.no_grad():
            engine.model(input_ids=torch.tensor([gen.prompt_ids + gen.response_ids]))
        forced = rec.pass_ids(0).permute(1, 0, 2)[: tokens - 1]
        assert torch.equal(forced.sort(-1).values, routed[:-1].long().sort(-1).values)


async def test_a_dense_model_records_nothing(tmp_path) -> None:
    engine = HFEngine.from_pretrained(build_tiny_model(ModelInitConfig(vocab_size=261), tmp_path))
    (gen,) = await engine.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=1))
    assert gen.routed_experts is None


async def test_stop_strings_cut_the_routing_with_the_response(folder) -> None:
    from relax.roles._rollout import stop_at_strings

    engine = HFEngine.from_pretrained(folder)
    (gen,) = await engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=2))
    text = engine.tokenizer.decode(gen.response_ids[:2])
    cut = stop_at_strings(gen, engine.tokenizer, [text])
    kept = len(cut.response_ids)
    assert kept < len(gen.response_ids)
    assert torch.equal(cut.routed_experts, gen.routed_experts[: len(gen.prompt_ids) + kept])


async def test_the_record_is_the_routers_own_output_call_by_call(folder) -> None:
    """One prompt: the prefill's router outputs are the prompt's rows, each decode step's the
    next response token's, exactly (a hook of ours sees every call)."""
    engine = HFEngine.from_pretrained(folder)
    calls: list[torch.Tensor] = []
    routers = RoutingRecorder(engine.model).routers
    hooks = [
        r.register_forward_hook(lambda m, a, out: calls.append(out[2].clone())) for r in routers
    ]
    (gen,) = await engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=4, seed=7))
    for hook in hooks:
        hook.remove()
    layers = len(routers)
    passes = [torch.stack(calls[i : i + layers]) for i in range(0, len(calls), layers)]
    assert len(passes) == len(gen.response_ids)  # the prefill, then every token but the last
    expected = torch.cat([passes[0], *passes[1:]], 1).permute(1, 0, 2)  # [tokens - 1, L, k]
    assert torch.equal(gen.routed_experts[:-1].long(), expected)


async def test_a_weight_update_mid_generation_keeps_the_record_aligned(folder) -> None:
    """Interruptible: the tokens fed before the update were routed by the old weights (the
    same as a teacher-forced pass of them), and the record stays one entry per token."""
    import asyncio

    from tests.polling import wait_until

    engine = HFEngine.from_pretrained(folder, interruptible=True)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    task = asyncio.create_task(
        engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=150, seed=0))
    )
    await wait_until(lambda: engine._generating, what="the decode loop to run")
    await engine.load_weights(1, new)
    (gen,) = await task
    switch = gen.token_versions.index(1)
    assert 0 < switch < len(gen.response_ids)
    tokens = gen.prompt_ids + gen.response_ids
    assert tuple(gen.routed_experts.shape) == (len(tokens), 2, 2)
    # Fed before the update: the prompt and the replies sampled before the switch but the last.
    before = len(gen.prompt_ids) + switch - 1
    engine.model.load_state_dict(old)
    with RoutingRecorder(engine.model) as rec, torch.no_grad():
        engine.model(input_ids=torch.tensor([tokens[:before]]))
    forced = rec.pass_ids(0).permute(1, 0, 2).sort(-1).values
    assert torch.equal(forced, gen.routed_experts[:before].long().sort(-1).values)
