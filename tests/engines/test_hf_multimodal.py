"""HFEngine with media: the tiny Qwen2.5-Omni thinker (``ModelInitConfig(arch="qwen2_5_omni")``)
generating from image / audio / video / mixed / text-only prompts, whose logprobs a training
forward (prompt + response, the same media tensors, no position ids) reproduces."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relax.config import ModelInitConfig
from relax.engines import EngineError, Generation, HFEngine, SamplingParams
from relax.media import draw_shapes, moving_square, tones
from relax.models import (
    build_tiny_model,
    load_policy,
    processor_kwargs,
    suppressed_token_ids,
)
from tests.actors.helpers import wait_until
from tests.models.helpers import build_omni, omni_dir_fixture, processor_fixture  # noqa: F401

pytestmark = pytest.mark.anyio

Prompt = tuple[list[int], dict[str, torch.Tensor] | None]


@pytest.fixture(scope="module")
def omni_dir_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes, another seed: the "next version" of the weights."""
    return build_omni(tmp_path_factory.mktemp("omni1"), seed=1)


@pytest.fixture(scope="module")
def references(omni_dir: Path, omni_dir_other: Path) -> dict[int, torch.nn.Module]:
    """Independent copies of the version-0 and version-1 weights, for recomputation."""
    return {0: load_policy(omni_dir)[0], 1: load_policy(omni_dir_other)[0]}


@pytest.fixture
def engine(omni_dir: Path) -> HFEngine:
    return HFEngine.from_pretrained(omni_dir, max_batch_size=16)


def _process(processor: Any, content: Any, *, fps: float | None = None, **media: Any) -> Prompt:
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    out = processor(
        text=[text], return_tensors="pt", **media, **processor_kwargs(processor, fps=fps)
    )
    ids = out["input_ids"][0].tolist()
    mm = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    return ids, mm or None


@pytest.fixture(scope="module")
def prompts(processor: Any) -> dict[str, Prompt]:
    """One prompt per kind of media, of different lengths (the batch is left-padded)."""
    image = draw_shapes(0, size=96)[0].numpy()
    small = draw_shapes(1, size=56)[0].numpy()
    audio = tones(0, seconds=1.0)[0].numpy()
    short = tones(1, seconds=0.4)[0].numpy()
    video = moving_square(0)[0].numpy()
    return {
        "image": _process(
            processor, [{"type": "image"}, {"type": "text", "text": "How many?"}], images=[image]
        ),
        "audio": _process(
            processor, [{"type": "audio"}, {"type": "text", "text": "Higher?"}], audio=[audio]
        ),
        "video": _process(
            processor,
            [{"type": "text", "text": "Where does it go?"}, {"type": "video"}],
            videos=[video],
            fps=2.0,
        ),
        "text": _process(processor, "Just text, no media at all."),
        "mixed": _process(
            processor,
            [
                {"type": "image"},
                {"type": "audio"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "video"},
                {"type": "audio"},
            ],
            images=[image, small],
            audio=[audio, short],
            videos=[video],
            fps=4.0,
        ),
    }


def recompute(
    model: torch.nn.Module,
    gen: Generation,
    mm: dict[str, torch.Tensor] | None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """What a trainer computes: one forward over prompt + response with the prompt's media, no
    position ids, the suppressed ids masked, then log_softmax(logits / T)."""
    ids = torch.tensor([gen.prompt_ids + gen.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **(mm or {})).logits
    logits = logits[0, len(gen.prompt_ids) - 1 : -1].float()
    logits[:, suppressed_token_ids(model)] = float("-inf")
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(gen.response_ids)[:, None])[:, 0]


def close(
    gen: Generation, model: torch.nn.Module, mm: dict[str, torch.Tensor] | None, t: float = 1.0
) -> bool:
    return torch.allclose(torch.tensor(gen.logprobs), recompute(model, gen, mm, t), atol=1e-4)


def _batch(prompts: dict[str, Prompt], names: list[str]) -> tuple[list[list[int]], list[Any]]:
    return [prompts[n][0] for n in names], [prompts[n][1] for n in names]


NAMES = ["image", "audio", "video", "text", "mixed"]


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize(("temperature", "n"), [(1.0, 2), (0.7, 3), (0.0, 1)])
async def test_logprobs_equal_a_training_forward(
    engine: HFEngine,
    prompts: dict[str, Prompt],
    references: dict[int, torch.nn.Module],
    temperature: float,
    n: int,
) -> None:
    ids, mm = _batch(prompts, NAMES)
    gens = await engine.generate(
        ids,
        SamplingParams(max_new_tokens=16, temperature=temperature, n=n),
        seeds=[1, 2, 3, 4, 5],
        mm_inputs=mm,
    )
    assert len(gens) == len(NAMES) * n
    banned = set(engine.suppressed_token_ids)
    assert banned and banned == set(suppressed_token_ids(references[0]))
    for k, gen in enumerate(gens):
        assert gen.prompt_ids == ids[k // n] and gen.index == k % n
        assert len(gen.response_ids) == 16 and not banned & set(gen.response_ids)
        assert close(gen, references[0], mm[k // n], temperature or 1.0)


async def test_suppressed_ids_are_never_sampled_even_when_favoured(
    omni_dir: Path, prompts: dict[str, Prompt]
) -> None:
    model, tokenizer = load_policy(omni_dir)
    banned = suppressed_token_ids(model)

    bonus = torch.zeros(len(tokenizer))
    bonus[banned] = 30.0  # unmasked, these would win nearly every draw

    def favour_banned(_module: Any, _inputs: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits + bonus

    model.lm_head.register_forward_hook(favour_banned)
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
    ids, mm = _batch(prompts, NAMES)
    for temperature in (1.0, 0.0):
        gens = await engine.generate(
            ids,
            SamplingParams(max_new_tokens=8, temperature=temperature, n=2, seed=0),
            mm_inputs=mm,
        )
        for k, gen in enumerate(gens):
            assert not set(banned) & set(gen.response_ids)
            assert close(gen, model, mm[k // 2])  # the masked distribution's logprobs


async def test_same_seed_same_samples_whatever_the_batch(
    omni_dir: Path, engine: HFEngine, prompts: dict[str, Prompt]
) -> None:
    kwargs: dict[str, Any] = {"max_new_tokens": 12, "n": 2}
    ids, mm = _batch(prompts, NAMES)
    together = await engine.generate(
        ids, SamplingParams(**kwargs), seeds=[10, 11, 12, 13, 14], mm_inputs=mm
    )
    for i, name in enumerate(NAMES):
        alone = await engine.generate(
            [prompts[name][0]],
            SamplingParams(**kwargs),
            seeds=[10 + i],
            mm_inputs=[prompts[name][1]],
        )
        assert [g.response_ids for g in alone] == [
            g.response_ids for g in together[2 * i : 2 * i + 2]
        ]
    # Other neighbours, and one sequence per forward pass: still the same samples.
    narrow = HFEngine.from_pretrained(omni_dir, max_batch_size=1)
    pair = await narrow.generate(
        [ids[4], ids[0]], SamplingParams(**kwargs), seeds=[14, 10], mm_inputs=[mm[4], mm[0]]
    )
    assert [g.response_ids for g in pair] == [
        g.response_ids for g in together[8:10] + together[0:2]
    ]
    other = await engine.generate(
        ids, SamplingParams(**kwargs), seeds=[20, 21, 22, 23, 24], mm_inputs=mm
    )
    assert [g.response_ids for g in other] != [g.response_ids for g in together]


async def test_stale_rope_state_on_the_model_changes_nothing(
    engine: HFEngine, prompts: dict[str, Prompt], references: dict[int, torch.nn.Module]
) -> None:
    ids, mm = _batch(prompts, ["mixed", "video"])
    first = await engine.generate(
        ids, SamplingParams(max_new_tokens=10), seeds=[1, 2], mm_inputs=mm
    )
    engine.model.rope_deltas = torch.full((7, 1), 999)  # as if left by someone else's forward
    again = await engine.generate(
        ids, SamplingParams(max_new_tokens=10), seeds=[1, 2], mm_inputs=mm
    )
    assert [g.response_ids for g in again] == [g.response_ids for g in first]
    assert all(close(g, references[0], m) for g, m in zip(again, mm, strict=True))


async def test_load_weights_changes_outputs(
    engine: HFEngine, prompts: dict[str, Prompt], references: dict[int, torch.nn.Module]
) -> None:
    ids, mm = _batch(prompts, NAMES)
    before = await engine.generate(
        ids, SamplingParams(max_new_tokens=10, temperature=0), mm_inputs=mm
    )
    await engine.load_weights(1, references[1].state_dict())
    assert engine.version == 1
    after = await engine.generate(
        ids, SamplingParams(max_new_tokens=10, temperature=0), mm_inputs=mm
    )
    assert [g.response_ids for g in before] != [g.response_ids for g in after]
    for gen, media in zip(after, mm, strict=True):
        assert gen.version == 1 and close(gen, references[1], media)
        assert not close(gen, references[0], media)


async def test_interruptible_swap_between_tokens_with_media(
    omni_dir: Path, prompts: dict[str, Prompt], references: dict[int, torch.nn.Module]
) -> None:
    engine = HFEngine.from_pretrained(omni_dir, max_batch_size=16, interruptible=True)
    ids, mm = _batch(prompts, NAMES)
    task = asyncio.create_task(
        engine.generate(ids, SamplingParams(max_new_tokens=200, n=2, seed=0), mm_inputs=mm)
    )
    await wait_until(lambda: engine._generating, what="the decode loop to run")
    await engine.load_weights(1, references[1].state_dict())
    gens = await task
    assert engine.statistics()["interrupted_loads"] == 1
    for k, gen in enumerate(gens):
        versions = gen.token_versions
        assert versions is not None and len(versions) == 200
        switch = versions.index(1)
        assert switch > 0 and versions == [0] * switch + [1] * (200 - switch)
        old = recompute(references[0], gen, mm[k // 2])[:switch]
        assert torch.allclose(torch.tensor(gen.logprobs[:switch]), old, atol=1e-4)
    after = await engine.generate(ids, SamplingParams(max_new_tokens=6, seed=1), mm_inputs=mm)
    assert all(
        g.version == 1 and close(g, references[1], m) for g, m in zip(after, mm, strict=True)
    )


def _without(mm: dict[str, torch.Tensor] | None, key: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in (mm or {}).items() if k != key}


def _cases(prompts: dict[str, Prompt]) -> Iterator[tuple[list[int], Any, str]]:
    """(prompt, its mm_inputs entry, the error expected) for malformed media."""
    image, audio, video, text = (prompts[n] for n in ("image", "audio", "video", "text"))
    yield image[0], None, "image placeholder tokens but its mm_inputs have no pixel_values"
    yield image[0], audio[1], "image placeholder tokens but"
    yield audio[0], image[1], "has 0 image placeholder tokens"
    yield text[0], image[1], "0 image placeholder tokens"
    # Another image size: 9 image tokens in the prompt, 4 in the media (mixed's small image).
    other = prompts["mixed"][1]
    assert other is not None
    four = {
        "pixel_values": other["pixel_values"][36:52],
        "image_grid_thw": other["image_grid_thw"][1:],
    }
    yield image[0], four, "9 image placeholder tokens .* fill 4"
    assert image[1] is not None and audio[1] is not None and video[1] is not None
    yield image[0], {**image[1], "pixel_values": image[1]["pixel_values"][:-4]}, "patches"
    yield image[0], _without(image[1], "image_grid_thw"), "no 'image_grid_thw'"
    yield image[0], {**image[1], "image_grid_thw": torch.tensor([1, 8, 8])}, "must be integers"
    yield audio[0], _without(audio[1], "feature_attention_mask"), "no 'feature_attention_mask'"
    yield audio[0], {**audio[1], "input_features": audio[1]["input_features"][0]}, "disagree"
    yield video[0], _without(video[1], "video_second_per_grid"), "video_second_per_grid"
    yield image[0], {**image[1], "pixels": torch.ones(1)}, "'pixels', which the model does not take"
    yield image[0], {**image[1], "image_grid_thw": [[1, 8, 8]]}, "must be a tensor"
    yield image[0], [image[1]], "must be a dict of tensors"


async def test_malformed_media_is_refused_clearly(
    engine: HFEngine, prompts: dict[str, Prompt], references: dict[int, torch.nn.Module]
) -> None:
    for prompt, media, message in _cases(prompts):
        with pytest.raises(EngineError, match=message):
            await engine.generate([prompt], SamplingParams(max_new_tokens=4), mm_inputs=[media])
    ids, mm = _batch(prompts, ["image", "audio"])
    with pytest.raises(EngineError, match="one entry"):
        await engine.generate(ids, SamplingParams(max_new_tokens=4), mm_inputs=mm[:1])
    with pytest.raises(EngineError, match="one entry"):
        await engine.generate(ids[:1], SamplingParams(max_new_tokens=4), mm_inputs=mm[0])
    # Nothing ran, nothing broke.
    assert engine.statistics()["requests"] == 0
    gens = await engine.generate(ids, SamplingParams(max_new_tokens=4, seed=0), mm_inputs=mm)
    assert all(close(g, references[0], m) for g, m in zip(gens, mm, strict=True))


async def test_text_model_without_media(tmp_path: Path) -> None:
    folder = build_tiny_model(ModelInitConfig(hidden_size=32, num_layers=1), tmp_path)
    engine = HFEngine.from_pretrained(folder)
    assert not engine.multimodal and engine.suppressed_token_ids == []
    a = await engine.generate([[257, 104, 105]], SamplingParams(max_new_tokens=5, seed=0))
    b = await engine.generate(
        [[257, 104, 105]], SamplingParams(max_new_tokens=5, seed=0), mm_inputs=[None]
    )
    assert a[0].response_ids == b[0].response_ids and len(a[0].response_ids) == 5
    with pytest.raises(EngineError, match="text-only"):
        await engine.generate(
            [[257, 104]],
            SamplingParams(max_new_tokens=2),
            mm_inputs=[{"pixel_values": torch.ones(4, 3)}],
        )
