"""The tiny Qwen3-Omni-MoE thinker (``[model.init] arch = "qwen3_omni_moe"``): built offline,
loaded like a checkpoint with its processor, and generating from image + audio prompts with the
HF engine, which records for every token — media placeholders included — the experts its
routers chose (what R3 replays), through left padding and the prefill of the media."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen3OmniMoeThinkerForConditionalGeneration

from relax.config import ModelInitConfig
from relax.engines import HFEngine, SamplingParams
from relax.media import draw_shapes, tones
from relax.models import (
    RoutingRecorder,
    build_tiny_model,
    load_processor,
    media_token_ids,
    moe_shape,
)

pytestmark = pytest.mark.anyio
INIT = ModelInitConfig(
    arch="qwen3_omni_moe",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    seed=3,
)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(INIT, tmp_path_factory.mktemp("omni-moe"))


def test_the_folder_loads_like_a_checkpoint(folder: Path, tmp_path: Path) -> None:
    processor = load_processor(folder)
    assert type(processor).__name__ == "Qwen3OmniMoeProcessor"
    assert processor.image_processor.patch_size == 16  # Qwen3's, not Qwen2.5's 14
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert type(model) is Qwen3OmniMoeThinkerForConditionalGeneration
    shape = moe_shape(model)
    assert shape is not None and (shape.layers, shape.top_k, shape.num_experts) == (2, 2, 4)
    assert set(media_token_ids(processor.tokenizer)) <= set(model.generation_config.suppress_tokens)
    again = build_tiny_model(INIT, tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


async def test_media_prompts_record_the_experts_the_routers_chose(folder: Path) -> None:
    processor = load_processor(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompts, media = [], []
    for i, prefix in enumerate(["", "a longer prompt: "]):  # rows of different lengths
        inputs = processor(
            text=[prefix + text],
            images=[draw_shapes(i, size=64 + 32 * i)[0].numpy()],
            audio=[tones(i, seconds=0.5 + i)[0].numpy()],
            return_tensors="pt",
        )
        prompts.append(inputs["input_ids"][0].tolist())
        media.append({k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")})
    engine = HFEngine.from_pretrained(folder)
    gens = await engine.generate(
        prompts, SamplingParams(max_new_tokens=5, n=2, seed=1), mm_inputs=media
    )
    for k, gen in enumerate(gens):
        routed = gen.routed_experts
        tokens = len(gen.prompt_ids) + len(gen.response_ids)
        assert routed is not None and tuple(routed.shape) == (tokens, 2, 2)
        assert (routed[-1] == 4).all() and (routed[:-1] < 4).all()
        # One teacher-forced pass with the same media routes every token the same way (with
        # an attention mask, as the trainer's forward: without one, Qwen3-Omni places the
        # audio tokens otherwise).
        ids = torch.tensor([gen.prompt_ids + gen.response_ids])
        with RoutingRecorder(engine.model) as rec, torch.no_grad():
            engine.model(input_ids=ids, attention_mask=torch.ones_like(ids), **media[k // 2])
        forced = rec.pass_ids(0).permute(1, 0, 2)[: tokens - 1]
        assert torch.equal(forced.sort(-1).values, routed[:-1].long().sort(-1).values)
