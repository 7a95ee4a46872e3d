"""process_prompt: chat prompts with images, audio and video → prompt ids + the model's media
tensors, decoded once; every bad part is a MediaError naming the record and the part; the
tensors cross the wire bit-exactly."""

from __future__ import annotations

import base64
import dataclasses
import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import relax.media._process as process_module
from relax.config import MediaConfig
from relax.errors import ConfigError
from relax.media import MediaError, MediaLimits, draw_shapes, moving_square, tones
from relax.media._process import (
    ProcessedPrompt,
    has_media,
    media_limits,
    mm_from_wire,
    process_prompt,
)
from relax.models import build_tiny_omni_model, load_omni_processor, omni_processor
from relax.transport import RawTensor, dumps, loads

LIMITS = MediaLimits(max_pixels=112 * 112, max_frames=8, video_fps=2.0, max_audio_seconds=4.0)
MERGE = 4  # 2x2 patches per placeholder token
IMAGE_ID, AUDIO_ID, VIDEO_ID = 266, 261, 267


@pytest.fixture(scope="module")
def processor() -> Any:
    return omni_processor()


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.round(samples * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def _image() -> np.ndarray:
    return draw_shapes(0, size=56)[0].numpy()


def _audio(seconds: float = 1.0, rate: int = 16_000) -> np.ndarray:
    return tones(0, seconds=seconds, sample_rate=rate)[0].numpy()


def _video(frames: int = 4) -> np.ndarray:
    return moving_square(0, frames=frames, size=56, square=14)[0].numpy()


def _audio_tokens(mask_sum: int) -> int:
    return ((mask_sum - 1) // 2 + 1 - 2) // 2 + 1


def _count(ids: list[int], token: int) -> int:
    return sum(1 for i in ids if i == token)


# --------------------------------------------------------------------------- config, has_media


def test_media_limits_from_the_config_field_by_field() -> None:
    limit_fields = {f.name for f in dataclasses.fields(MediaLimits)}
    assert limit_fields == set(MediaConfig.model_fields)
    cfg = MediaConfig(
        max_pixels=1000,
        min_pixels=100,
        max_frames=3,
        video_fps=1.5,
        max_audio_seconds=2.5,
        sample_rate=8000,
        max_bytes=12345,
        resample=False,
        truncate=False,
    )
    limits = media_limits(cfg)
    assert {name: getattr(limits, name) for name in limit_fields} == cfg.model_dump()
    assert media_limits(cfg.model_dump()) == limits
    assert media_limits(None) == MediaLimits()
    assert media_limits({"max_frames": 5}) == MediaLimits(max_frames=5)
    with pytest.raises(ValueError, match="max_frame"):
        media_limits({"max_frame": 5})


def test_has_media() -> None:
    assert not has_media("1+2=")
    assert not has_media([{"role": "user", "content": "1+2="}])
    assert not has_media(_user(_text("hi"), _text("there")))
    assert has_media(_user(_text("hi"), {"type": "image", "image": "x.png"}))
    assert has_media(_user({"type": "audio", "audio": "x.wav"}))
    assert has_media(_user({"type": "smell"}))  # unknown: process_prompt refuses it
    assert not has_media(None)


# --------------------------------------------------------------------------- one modality each


def test_image_prompt_and_every_source_form(processor: Any, tmp_path: Path) -> None:
    pixels = _image()
    png = _png(pixels)
    (tmp_path / "shape.png").write_bytes(png)
    data_uri = "data:image/png;base64," + base64.b64encode(png).decode()
    sources = [
        pixels,
        torch.from_numpy(pixels),
        png,
        str(tmp_path / "shape.png"),
        tmp_path / "shape.png",
        f"file://{tmp_path / 'shape.png'}",
        data_uri,
        {"bytes": png, "path": None},
        {"path": str(tmp_path / "shape.png")},
    ]
    outs = [
        process_prompt(
            processor, _user({"type": "image", "image": src}, _text("Colour?")), LIMITS, item="r"
        )
        for src in sources
    ]
    first = outs[0]
    assert isinstance(first, ProcessedPrompt)
    assert set(first.mm_inputs) == {"pixel_values", "image_grid_thw"}
    grid = first.mm_inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # 56x56: 4x4 patches of 14
    assert first.media_tokens == _count(first.prompt_ids, IMAGE_ID) == int(grid.prod()) // MERGE
    assert first.counts == {"image": 1, "audio": 0, "video": 0}
    assert first.text.count("<|IMAGE|>") == 1 and first.text.endswith("<|im_start|>assistant\n")
    assert first.mm_inputs["pixel_values"].shape == (16, 1176)
    for out in outs[1:]:
        assert out.prompt_ids == first.prompt_ids
        assert torch.equal(out.mm_inputs["pixel_values"], first.mm_inputs["pixel_values"])


def test_audio_prompt(processor: Any, tmp_path: Path) -> None:
    clip = _audio(1.0)
    out = process_prompt(
        processor,
        _user(
            {"type": "audio", "audio": {"array": clip, "sampling_rate": 16_000}}, _text("1 or 2?")
        ),
        LIMITS,
        item="r",
    )
    assert set(out.mm_inputs) == {"input_features", "feature_attention_mask"}
    mask = out.mm_inputs["feature_attention_mask"]
    assert int(mask.sum()) == 100  # 1 s of 10 ms frames
    assert out.media_tokens == _count(out.prompt_ids, AUDIO_ID) == _audio_tokens(100) == 25
    # A 44.1 kHz WAV file is resampled; a raw array takes its rate from the part.
    (tmp_path / "t.wav").write_bytes(_wav(_audio(1.0, 44_100), 44_100))
    wav = process_prompt(
        processor, _user({"type": "audio", "audio": str(tmp_path / "t.wav")}), LIMITS, item="r"
    )
    assert int(wav.mm_inputs["feature_attention_mask"].sum()) == 100
    raw = process_prompt(
        processor,
        _user({"type": "audio", "audio": clip, "sampling_rate": 16_000}),
        LIMITS,
        item="r",
    )
    assert raw.media_tokens == 25


def test_video_prompt(processor: Any) -> None:
    video = _video(4)
    out = process_prompt(
        processor, _user({"type": "video", "video": video}, _text("l or r?")), LIMITS, item="r"
    )
    assert set(out.mm_inputs) == {"pixel_values_videos", "video_grid_thw", "video_second_per_grid"}
    grid = out.mm_inputs["video_grid_thw"]
    assert grid.tolist() == [[2, 4, 4]]
    assert out.media_tokens == _count(out.prompt_ids, VIDEO_ID) == int(grid.prod()) // MERGE == 8
    # Frames without a rate are taken as sampled at video_fps: 2 frames per grid at 2 fps.
    assert out.mm_inputs["video_second_per_grid"].tolist() == [1.0]
    # A list of frames is the same video; a part's fps sets the temporal positions.
    frames = process_prompt(
        processor, _user({"type": "video", "video": list(video)}), LIMITS, item="r"
    )
    assert torch.equal(
        frames.mm_inputs["pixel_values_videos"], out.mm_inputs["pixel_values_videos"]
    )
    slow = process_prompt(
        processor, _user({"type": "video", "video": video, "fps": 1.0}), LIMITS, item="r"
    )
    assert slow.mm_inputs["video_second_per_grid"].tolist() == [2.0]


def test_mixed_prompt_keeps_order_and_matches_the_grids(processor: Any) -> None:
    red = np.full((56, 56, 3), (220, 30, 30), np.uint8)
    blue = np.full((112, 56, 3), (40, 70, 220), np.uint8)
    prompt = [
        {"role": "system", "content": "Answer with one character."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": red},
                _text("and"),
                {"type": "audio", "audio": {"array": _audio(0.5), "sampling_rate": 16_000}},
                {"type": "video", "video": _video(4)},
                {"type": "image", "image": blue},
                _text("?"),
            ],
        },
    ]
    out = process_prompt(processor, prompt, LIMITS, item="mix")
    mm = out.mm_inputs
    assert out.counts == {"image": 2, "audio": 1, "video": 1}
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 4]]
    images = int(mm["image_grid_thw"].prod(-1).sum()) // MERGE
    videos = int(mm["video_grid_thw"].prod(-1).sum()) // MERGE
    audios = _audio_tokens(int(mm["feature_attention_mask"].sum()))
    ids = out.prompt_ids
    assert (_count(ids, IMAGE_ID), _count(ids, VIDEO_ID), _count(ids, AUDIO_ID)) == (
        images,
        videos,
        audios,
    )
    assert out.media_tokens == images + videos + audios == 4 + 8 + 8 + 12
    # Items keep their order: the red image's patches come first.
    alone = [
        process_prompt(processor, _user({"type": "image", "image": im}), LIMITS, item="x")
        for im in (red, blue)
    ]
    expected = torch.cat([a.mm_inputs["pixel_values"] for a in alone])
    assert torch.equal(mm["pixel_values"], expected)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in mm.values())
    assert out.text.startswith("<|im_start|>system\nAnswer with one character.<|im_end|>\n")


def test_each_video_keeps_its_own_rate(processor: Any) -> None:
    video = _video(4)
    prompt = _user(
        {"type": "video", "video": video, "fps": 2.0},
        {"type": "video", "video": video, "fps": 1.0},
    )
    out = process_prompt(processor, prompt, LIMITS, item="r")
    assert out.mm_inputs["video_second_per_grid"].tolist() == [1.0, 2.0]


def test_text_only(processor: Any) -> None:
    tokenizer = processor.tokenizer
    out = process_prompt(processor, [{"role": "user", "content": "3+4="}], LIMITS, item="t")
    assert out.mm_inputs == {} and out.media_tokens == 0
    assert out.text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_ids == tokenizer.encode(out.text, add_special_tokens=False)
    parts = process_prompt(processor, _user(_text("3+"), _text("4=")), LIMITS, item="t")
    assert parts.prompt_ids == out.prompt_ids and parts.mm_inputs == {}
    # A plain string is tokenized as it is (no template), as text prompts always were;
    # a tokenizer alone serves text prompts.
    raw = process_prompt(processor, "3+4=", LIMITS, item="t")
    assert raw.prompt_ids == tokenizer.encode("3+4=", add_special_tokens=False)
    assert raw.text == "3+4=" and raw.mm_inputs == {}
    assert process_prompt(tokenizer, "3+4=", LIMITS, item="t") == raw
    by_tokenizer = process_prompt(
        tokenizer, [{"role": "user", "content": "3+4="}], LIMITS, item="t"
    )
    assert by_tokenizer.prompt_ids == out.prompt_ids


def test_every_item_is_decoded_once(processor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {"image": 0, "audio": 0, "video": 0}

    def counting(kind: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[kind] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(process_module, "load_image", counting("image", process_module.load_image))
    monkeypatch.setattr(process_module, "load_audio", counting("audio", process_module.load_audio))
    monkeypatch.setattr(
        process_module, "load_video_clip", counting("video", process_module.load_video_clip)
    )
    prompt = _user(
        {"type": "image", "image": _image()},
        {"type": "image", "image": _image()},
        {"type": "audio", "audio": {"array": _audio(0.5), "sampling_rate": 16_000}},
        {"type": "video", "video": _video(4)},
        _text("?"),
    )
    out = process_prompt(processor, prompt, LIMITS, item="once")
    assert calls == {"image": 2, "audio": 1, "video": 1} == out.counts


def test_the_tiny_model_takes_the_inputs_as_they_are(tmp_path: Path) -> None:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    folder = build_tiny_omni_model(tmp_path / "omni")
    processor = load_omni_processor(folder)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder).eval()
    prompt = _user(
        {"type": "image", "image": _image()},
        {"type": "audio", "audio": {"array": _audio(0.5), "sampling_rate": 16_000}},
        {"type": "video", "video": _video(4)},
        _text("?"),
    )
    out = process_prompt(processor, prompt, LIMITS, item="fwd")
    ids = torch.tensor([out.prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **out.mm_inputs).logits
    assert logits.shape[:2] == (1, len(out.prompt_ids))
    assert bool(torch.isfinite(logits).all())


def test_audio_features_are_cut_to_the_frames_used_without_changing_the_model(
    tmp_path: Path,
) -> None:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    folder = build_tiny_omni_model(tmp_path / "omni")
    processor = load_omni_processor(folder)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder).eval()
    clip = {"array": _audio(1.0), "sampling_rate": 16_000}
    out = process_prompt(processor, _user({"type": "audio", "audio": clip}), LIMITS, item="t")
    features, mask = out.mm_inputs["input_features"], out.mm_inputs["feature_attention_mask"]
    window = processor.feature_extractor.nb_max_frames
    assert features.shape[-1] == mask.shape[-1] == 100 < window  # 1 s kept, not the window
    padded = {
        "input_features": torch.nn.functional.pad(features, (0, window - 100)),
        "feature_attention_mask": torch.nn.functional.pad(mask, (0, window - 100)),
    }
    ids = torch.tensor([out.prompt_ids])
    with torch.no_grad():
        cut = model(input_ids=ids, attention_mask=torch.ones_like(ids), **out.mm_inputs).logits
        full = model(input_ids=ids, attention_mask=torch.ones_like(ids), **padded).logits
    assert torch.equal(cut, full)


# --------------------------------------------------------------------------- bad prompts


def _bad_cases(tmp: Path) -> list[tuple[str, Any, MediaLimits, str, str]]:
    """(case, prompt, limits, where, reason regex): where is what the error names."""
    png = _png(_image())
    (tmp / "slow.wav").write_bytes(_wav(_audio(0.5, 8000), 8000))
    at_0 = "rec message 0 part 0"
    return [
        (
            "missing image file",
            _user({"type": "image", "image": str(tmp / "nope.png")}),
            LIMITS,
            at_0,
            "file does not exist",
        ),
        (
            "corrupt bytes",
            _user({"type": "image", "image": b"\x89PNG\r\n\x1a\n garbage"}),
            LIMITS,
            at_0,
            "corrupt|not an image",
        ),
        (
            "truncated png",
            _user({"type": "image", "image": png[: len(png) // 2]}),
            LIMITS,
            at_0,
            "corrupt or truncated",
        ),
        (
            "corrupt data uri",
            _user({"type": "image", "image": "data:image/png;base64,@@@"}),
            LIMITS,
            at_0,
            "corrupt data URI",
        ),
        (
            "remote url",
            _user({"type": "image", "image": "https://example.com/a.png"}),
            LIMITS,
            at_0,
            "not fetched",
        ),
        (
            "float pixels",
            _user({"type": "image", "image": np.zeros((8, 8, 3), np.float32)}),
            LIMITS,
            at_0,
            "uint8",
        ),
        (
            "missing audio file",
            _user({"type": "audio", "audio": str(tmp / "nope.wav")}),
            LIMITS,
            at_0,
            "file does not exist",
        ),
        (
            "rate without resampling",
            _user({"type": "audio", "audio": str(tmp / "slow.wav")}),
            dataclasses.replace(LIMITS, resample=False),
            at_0,
            "8000 Hz.*resampling is disabled",
        ),
        (
            "rate that cannot be resampled",
            _user({"type": "audio", "audio": {"array": _audio(0.1), "sampling_rate": 44_101}}),
            LIMITS,
            at_0,
            "cannot resample 44101 Hz",
        ),
        (
            "raw audio without a rate",
            _user({"type": "audio", "audio": _audio(0.1)}),
            LIMITS,
            at_0,
            "need their rate",
        ),
        (
            "audio longer than the window",
            _user({"type": "audio", "audio": {"array": _audio(5.0), "sampling_rate": 16_000}}),
            dataclasses.replace(LIMITS, max_audio_seconds=8.0, truncate=False),
            at_0,
            "window is 4 s",
        ),
        (
            "too many frames",
            _user({"type": "video", "video": _video(10)}),
            dataclasses.replace(LIMITS, truncate=False),
            at_0,
            "too many frames",
        ),
        (
            "ragged frames",
            _user(
                {
                    "type": "video",
                    "video": [np.zeros((56, 56, 3), np.uint8), np.zeros((28, 56, 3), np.uint8)],
                }
            ),
            LIMITS,
            at_0,
            "share one size",
        ),
        (
            "bad fps",
            _user({"type": "video", "video": _video(4), "fps": -1.0}),
            LIMITS,
            at_0,
            "invalid frame rate",
        ),
        (
            "unknown part type",
            _user(_text("hi"), {"type": "smell", "smell": "roses"}),
            LIMITS,
            "rec message 0 part 1",
            "unknown part type 'smell'",
        ),
        ("part without a source", _user({"type": "image"}), LIMITS, at_0, "no 'image' source"),
        ("text part without text", _user({"type": "text"}), LIMITS, at_0, "string 'text'"),
        (
            "spelled-out token",
            _user(_text("look: <|IMAGE|>")),
            LIMITS,
            "rec",
            r"1 <\|IMAGE\|> for 0 image",
        ),
        (
            "spelled-out token in a string",
            "look: <|IMAGE|>",
            LIMITS,
            "rec",
            "spells out a media placeholder",
        ),
        ("not messages", [{"content": "hi"}], LIMITS, "rec message 0", "'role' and 'content'"),
        ("empty", [], LIMITS, "rec", "non-empty list"),
    ]


def test_every_bad_part_names_the_record_and_the_part(processor: Any, tmp_path: Path) -> None:
    for case, prompt, limits, where, reason in _bad_cases(tmp_path):
        with pytest.raises(MediaError, match=reason) as info:
            process_prompt(processor, prompt, limits, item="rec")
        assert info.value.item.startswith(where), (case, info.value.item)
        assert "rec" in str(info.value), case


def test_a_modality_the_processor_lacks(processor: Any) -> None:
    tokenizer = processor.tokenizer  # no image processor, feature extractor or video processor
    for kind, src in (
        ("image", _image()),
        ("audio", {"array": _audio(0.1), "sampling_rate": 16_000}),
        ("video", _video(4)),
    ):
        with pytest.raises(MediaError, match=f"takes no {kind} input") as info:
            process_prompt(tokenizer, _user({"type": kind, kind: src}), LIMITS, item="rec")
        assert info.value.kind == kind and info.value.item.startswith("rec message 0 part 0")


def test_processor_limits_mismatch_is_a_config_error(processor: Any) -> None:
    clip = {"array": _audio(0.5), "sampling_rate": 16_000}
    with pytest.raises(ConfigError, match="expects 16000 Hz"):
        process_prompt(
            processor,
            _user({"type": "audio", "audio": clip}),
            dataclasses.replace(LIMITS, sample_rate=8000),
            item="r",
        )


def test_long_audio_is_cut_to_the_window_when_truncating(processor: Any) -> None:
    limits = dataclasses.replace(LIMITS, max_audio_seconds=8.0)
    clip = {"array": _audio(5.0), "sampling_rate": 16_000}
    out = process_prompt(processor, _user({"type": "audio", "audio": clip}), limits, item="r")
    assert int(out.mm_inputs["feature_attention_mask"].sum()) == 400  # the 4 s window


# --------------------------------------------------------------------------- the wire


def test_mm_inputs_cross_the_wire_bit_exactly(processor: Any) -> None:
    prompt = _user(
        {"type": "image", "image": _image()},
        {"type": "audio", "audio": {"array": _audio(0.5), "sampling_rate": 16_000}},
        {"type": "video", "video": _video(4)},
        _text("?"),
    )
    mm = process_prompt(processor, prompt, LIMITS, item="wire").mm_inputs
    assert {str(t.dtype) for t in mm.values()} >= {"torch.float32", "torch.int64", "torch.int32"}
    row = {"columns": {"prompt_ids": [1, 2], "mm_inputs": mm}}
    message = dumps(row)
    for raw in (False, True):
        column = loads(message, raw_tensors=raw)["columns"]["mm_inputs"]
        if raw:
            assert all(isinstance(v, RawTensor) for v in column.values())
        back = mm_from_wire(column)
        assert set(back) == set(mm)
        for key, tensor in mm.items():
            got = back[key]
            assert isinstance(got, torch.Tensor)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
            assert torch.equal(got.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), (
                key
            )
    # Forwarded by a store-and-forward hop (raw in, raw out), still the same bytes.
    forwarded = mm_from_wire(loads(dumps(loads(message, raw_tensors=True)))["columns"]["mm_inputs"])
    assert all(torch.equal(forwarded[k], mm[k]) for k in mm)
    assert mm_from_wire(None) == {} and mm_from_wire({}) == {}
    with pytest.raises(TypeError):
        mm_from_wire([1, 2])
    with pytest.raises(TypeError):
        mm_from_wire({"pixel_values": [1.0, 2.0]})
