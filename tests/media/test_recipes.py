"""Recipes: deterministic omni-modal tasks whose answers are read back from the pixels, samples
and frames; small prompts with the tiny omni processor; bad_media breaks every k-th record in
a way process_prompt refuses with a MediaError."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from relax.media import PALETTE, MediaError, MediaLimits, recipes
from relax.media._process import has_media, process_prompt
from relax.models import omni_processor

RECIPES = {
    "shape_colors": recipes.shape_colors,
    "higher_tone": recipes.higher_tone,
    "motion": recipes.motion,
    "arithmetic": recipes.arithmetic,
    "mixed": recipes.mixed,
    "bad_media": recipes.bad_media,
}


@pytest.fixture(scope="module")
def processor() -> Any:
    return omni_processor()


def _take(fn: Any, n: int, seed: int = 0, **kw: Any) -> list[dict[str, Any]]:
    return list(itertools.islice(fn(seed, **kw), n))


def _parts(record: dict[str, Any]) -> list[dict[str, Any]]:
    content = record["prompt"][-1]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _media(record: dict[str, Any], kind: str) -> Any:
    (part,) = [p for p in _parts(record) if p["type"] == kind]
    return part[kind]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_are_deterministic(name: str) -> None:
    fn = RECIPES[name]
    first, again, other = _take(fn, 10), _take(fn, 10), _take(fn, 10, seed=1)
    assert _same(first, again)
    assert not _same(first, other)
    ids = [r["id"] for r in first]
    assert len(set(ids)) == len(ids) and all(name in i for i in ids)
    assert all({"id", "prompt", "answer"} <= set(r) for r in first)


def test_shape_colour_is_the_shape_s_pixels() -> None:
    records = _take(recipes.shape_colors, 30)
    assert {r["answer"] for r in records} == {"r", "g", "b"}
    for record in records:
        pixels = _media(record, "image")
        assert pixels.dtype == np.uint8 and pixels.shape == (56, 56, 3)
        shape = ~(pixels == 255).all(-1)
        assert shape.sum() >= 14 * 14 * 3 // 4  # one large shape
        colour = recipes.SHAPE_COLORS[record["answer"]]
        assert (pixels[shape] == PALETTE[colour]).all()
        assert len(record["answer"]) == 1 and "r, g or b" in _parts(record)[-1]["text"]


def _peak_hz(audio: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio))))
    return float(np.argmax(spectrum) * rate / len(audio))


def test_higher_tone_is_the_higher_peak() -> None:
    records = _take(recipes.higher_tone, 20)
    assert {r["answer"] for r in records} == {"1", "2"}
    for record in records:
        clip = _media(record, "audio")
        audio, rate = clip["array"], clip["sampling_rate"]
        assert audio.dtype == np.float32 and rate == 16_000 and len(audio) <= rate
        half = len(audio) // 2
        first, second = _peak_hz(audio[:half], rate), _peak_hz(audio[half:], rate)
        assert record["answer"] == ("1" if first > second else "2")


def test_motion_direction_is_the_square_s_path() -> None:
    records = _take(recipes.motion, 20)
    assert {r["answer"] for r in records} == {"l", "r"}
    for record in records:
        video = _media(record, "video")
        assert video.dtype == np.uint8 and video.shape == (4, 56, 56, 3)
        xs = [np.nonzero(frame.any(-1))[1].mean() for frame in video]
        steps = np.diff(xs)
        assert (steps > 0).all() if record["answer"] == "r" else (steps < 0).all()


def test_arithmetic_answers_one_digit() -> None:
    for record in _take(recipes.arithmetic, 50):
        text = record["prompt"][0]["content"]
        a, b = text.removesuffix("=").split("+")
        assert record["answer"] == str(int(a) + int(b)) and len(record["answer"]) == 1
        assert not has_media(record["prompt"])


def test_mixed_runs_every_modality_in_turn() -> None:
    records = _take(recipes.mixed, 8)
    kinds = [next((p["type"] for p in _parts(r) if p["type"] != "text"), "text") for r in records]
    assert kinds == ["image", "audio", "video", "text"] * 2
    assert [has_media(r["prompt"]) for r in records[:4]] == [True, True, True, False]


def test_recipes_are_data_generators() -> None:
    from relax.roles._prompts import prompt_stream

    stream = prompt_stream({"generator": "relax.media.recipes:mixed", "seed": 3})
    assert _same(list(itertools.islice(stream, 6)), _take(recipes.mixed, 6, seed=3))


def test_prompts_are_small_and_process(processor: Any) -> None:
    limits = MediaLimits()
    for record in _take(recipes.mixed, 8):
        out = process_prompt(processor, record["prompt"], limits, item=record["id"])
        assert len(out.prompt_ids) <= 100, (record["id"], len(out.prompt_ids))


def test_bad_media_breaks_every_kth_record(processor: Any) -> None:
    every = 3
    records = _take(recipes.bad_media, every * len(recipes.FAULTS) + 2, every=every)
    faults = [r.get("fault") for r in records]
    assert faults[every - 1 :: every] == list(recipes.FAULTS)
    assert all(f is None for i, f in enumerate(faults) if i % every != every - 1)
    reasons = {
        "corrupt_image": "corrupt or truncated image",
        "missing_audio": "file does not exist",
        "unresamplable_audio": "cannot resample 44101 Hz",
        "ragged_video": "share one size",
        "unknown_part": "unknown part type 'smell'",
    }
    assert set(reasons) == set(recipes.FAULTS)
    limits = MediaLimits()
    for record in records:
        if record.get("fault") is None:
            process_prompt(processor, record["prompt"], limits, item=record["id"])
            continue
        assert has_media(record["prompt"])
        with pytest.raises(MediaError, match=reasons[record["fault"]]) as info:
            process_prompt(processor, record["prompt"], limits, item=record["id"])
        assert info.value.item.startswith(f"{record['id']} message 0 part 0")
