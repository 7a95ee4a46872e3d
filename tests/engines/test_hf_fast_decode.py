"""HFEngine's fast decode step (``relax.engines._fast_decode``): every step's logits are the
model forward pass's, bit for bit, so a generation is the same token for token and logprob for
logprob; a model it cannot run exactly, or one somebody hooked, decodes through ``model(...)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from relax.config import LoraConfig, ModelInitConfig
from relax.engines import HFEngine, SamplingParams
from relax.engines._fast_decode import FastCache, fast_decoder
from relax.models import apply_lora, build_tiny_model, load_policy, stop_token_ids
from tests.tiny import spread_lengths

pytestmark = pytest.mark.anyio

SIZES = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19]]


def _qwen3(folder: Path) -> None:
    """Replace the Qwen2 saved in ``folder`` by a Qwen3 of the same sizes (per-head q/k
    norms, no projection biases); the tokenizer files stay."""
    old = AutoConfig.from_pretrained(folder)
    config = Qwen3Config(
        vocab_size=old.vocab_size,
        hidden_size=old.hidden_size,
        intermediate_size=old.intermediate_size,
        num_hidden_layers=old.num_hidden_layers,
        num_attention_heads=old.num_attention_heads,
        num_key_value_heads=old.num_key_value_heads,
        head_dim=old.hidden_size // old.num_attention_heads,
        max_position_embeddings=old.max_position_embeddings,
        pad_token_id=old.pad_token_id,
        bos_token_id=old.bos_token_id,
        eos_token_id=old.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny policy of each supported architecture, stopping at widely spread lengths (so
    finished rows leave the decode batch), saved and loaded as a checkpoint is."""
    arch = request.param
    init = ModelInitConfig(arch="qwen2" if arch == "qwen3" else arch, **SIZES)
    folder = build_tiny_model(init, tmp_path_factory.mktemp(arch))
    if arch == "qwen3":
        _qwen3(folder)
    return spread_lengths(folder)


def _prefill(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor):
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True)
    return out.past_key_values, positions[:, -1:] + 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no padding"])
def test_every_step_s_logits_are_the_forward_pass_s(
    model_dir: Path, padded: bool, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FastCache, "GROWTH", 2)  # the cache's buffers grow several times
    model = load_policy(model_dir, dtype)[0].eval()
    fast = fast_decoder(model)
    assert fast is not None
    g = torch.Generator().manual_seed(1)
    lengths = [3, 7, 1, 5, 7] if padded else [5] * 5
    width, vocab = max(lengths), model.config.vocab_size
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    attention = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        attention[row, width - length :] = 1
        ids[row, : width - length] = 0
    with torch.inference_mode():
        cache, position = _prefill(model, ids, attention)
        state = fast.start(_prefill(model, ids, attention)[0], attention, 8)
        assert state is not None
        for step in range(8):
            feed = torch.randint(3, vocab, (position.shape[0], 1), generator=g)
            if step == 3:  # new weights copied in between two tokens, as an update lands
                for p in model.parameters():
                    p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
            if step == 5:  # rows leave the batch, as finished ones do
                keep = torch.tensor([0, 2, 3])
                cache.batch_select_indices(keep)
                state.batch_select_indices(keep)
                attention, position, feed = attention[keep], position[keep], feed[keep]
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            want = model(
                input_ids=feed,
                attention_mask=attention,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            got = fast.step(state, feed, position)
            assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max()}"
            position = position + 1


SAMPLINGS = {
    "one seed": ({"seed": 3}, None),
    "a seed per prompt, penalties, top logprobs": (
        {"presence_penalty": 0.5, "frequency_penalty": 0.3, "top_logprobs": 3},
        [21, 22, 23, 24],
    ),
    "greedy": ({"temperature": 0.0}, None),
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
async def test_a_generation_is_the_one_decoded_through_the_forward_pass(
    model_dir: Path, sampling: str
) -> None:
    fast = HFEngine.from_pretrained(model_dir)
    slow = HFEngine.from_pretrained(model_dir, fast_decode=False)
    assert fast._fast is not None and slow._fast is None
    options, seeds = SAMPLINGS[sampling]
    stops = stop_token_ids(fast.tokenizer)
    params = SamplingParams(max_new_tokens=40, n=4, stop_token_ids=stops, **options)
    a = await fast.generate(PROMPTS, params, seeds=seeds)
    b = await slow.generate(PROMPTS, params, seeds=seeds)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]  # exactly
    assert [g.finish_reason for g in a] == [g.finish_reason for g in b]
    assert [g.top_logprobs for g in a] == [g.top_logprobs for g in b]
    if sampling != "greedy":  # rows ended at many lengths: the batch was compacted
        assert len({len(g.response_ids) for g in a}) > 3


async def test_weights_switched_between_tokens_decode_the_same(model_dir: Path) -> None:
    """``regenerate`` switches versions between two tokens as an interruptible update does."""
    other = load_policy(model_dir)[0]
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.1)
    versions = {0: load_policy(model_dir)[0].state_dict(), 1: other.state_dict()}
    params = SamplingParams(max_new_tokens=12, n=2, stop_token_ids=[])
    schedules = [[0] * 4 + [1] * 8]
    runs = []
    for fast_decode in (True, False):
        engine = HFEngine.from_pretrained(model_dir, fast_decode=fast_decode)
        runs.append(engine.regenerate(PROMPTS, params, [1, 2, 3, 4], schedules, versions.get))
    a, b = runs
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.token_versions for g in a] == [g.token_versions for g in b]


async def test_a_hooked_model_decodes_through_its_forward_pass(model_dir: Path) -> None:
    engine = HFEngine.from_pretrained(model_dir)
    calls: list[int] = []
    handle = engine.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        gens = await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, seed=1))
    finally:
        handle.remove()
    assert len(calls) == len(gens[0].response_ids)  # the prefill and every step but the last
    calls.clear()
    await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, seed=1))
    assert calls == []  # unhooked: the fast path again


class _Sub(Qwen2ForCausalLM):
    """A subclass may change the forward pass: not taken for the class it extends."""


def test_models_it_cannot_run_exactly_keep_the_forward_pass(tmp_path: Path) -> None:
    folder = build_tiny_model(ModelInitConfig(**SIZES), tmp_path / "qwen2")
    assert fast_decoder(load_policy(folder)[0]) is not None
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    assert fast_decoder(eager) is None
    assert fast_decoder(_Sub(load_policy(folder)[0].config)) is None
    lora = apply_lora(load_policy(folder)[0], LoraConfig(rank=2))
    assert fast_decoder(lora) is None  # its projections are LoRA layers
    moe = ModelInitConfig(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, **SIZES)
    assert fast_decoder(load_policy(build_tiny_model(moe, tmp_path / "moe"))[0]) is None
