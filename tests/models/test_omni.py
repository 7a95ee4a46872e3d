"""The tiny omni model end to end: build offline, save, load like a checkpoint, generate from an
image + audio + video prompt, recompute the sampled tokens' log-probabilities in a training
forward from the same processed inputs, and back-propagate into the vision and audio towers."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, Qwen2_5OmniThinkerForConditionalGeneration

from relax.media import (
    MediaLimits,
    draw_shapes,
    load_audio,
    load_image,
    load_video_clip,
    moving_square,
    tones,
)
from relax.models import (
    build_tiny_omni_model,
    load_omni_processor,
    media_token_ids,
    processor_kwargs,
)

LIMITS = MediaLimits(max_pixels=128 * 128, max_frames=8, video_fps=4.0, max_audio_seconds=4.0)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_omni_model(tmp_path_factory.mktemp("omni"), seed=0)


def _media_files(folder: Path) -> tuple[Path, Path, Path]:
    """A PNG of shapes, a 44.1 kHz WAV of two tones, a 2 s GIF (10 fps) of a moving square."""
    image, _ = draw_shapes(0, size=96)
    Image.fromarray(image.numpy()).save(folder / "shapes.png")
    audio, _ = tones(0, sample_rate=44_100, seconds=1.5)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(44_100)
        out.writeframes(np.round(audio.numpy() * 32767).astype("<i2").tobytes())
    (folder / "tones.wav").write_bytes(buffer.getvalue())
    video, _ = moving_square(0, frames=20, size=32)
    frames = [Image.fromarray(f) for f in video.numpy()]
    frames[0].save(folder / "square.gif", save_all=True, append_images=frames[1:], duration=100)
    return folder / "shapes.png", folder / "tones.wav", folder / "square.gif"


def test_folder_loads_like_a_checkpoint(omni_dir: Path) -> None:
    names = {p.name for p in omni_dir.iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json"} <= names
    processor = load_omni_processor(omni_dir)
    assert type(processor).__name__ == "Qwen2_5OmniProcessor"
    assert processor.tokenizer.image_token == "<|IMAGE|>"
    assert processor.tokenizer.convert_tokens_to_ids("<|IMAGE|>") == 266
    model = AutoModelForImageTextToText.from_pretrained(omni_dir)
    assert type(model) is Qwen2_5OmniThinkerForConditionalGeneration
    assert model.config.image_token_id == 266 and model.config.get_text_config().vocab_size == 268
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_generate_then_train_on_the_same_processed_inputs(omni_dir: Path, tmp_path: Path) -> None:
    processor = load_omni_processor(omni_dir)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni_dir).eval()
    png, wav, gif = _media_files(tmp_path)
    image = load_image(png, LIMITS)
    audio = load_audio(wav, LIMITS)
    clip = load_video_clip(gif, LIMITS)
    assert audio.shape == (24_000,) and clip.frames.shape == (8, 32, 32, 3) and clip.fps == 4.0
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "audio"},
                {"type": "video"},
                {
                    "type": "text",
                    "text": "How many shapes? Which tone is higher? Where does it go?",
                },
            ],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text],
        images=[image.numpy()],
        audio=[audio.numpy()],
        videos=[clip.frames.numpy()],
        return_tensors="pt",
        **processor_kwargs(processor, fps=clip.fps),
    )
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 6]]  # 96x96 → 84x84: 9 image tokens
    assert inputs["video_grid_thw"].tolist() == [[4, 4, 4]]  # 8 frames of 32x32 → 56x56
    assert int(inputs["feature_attention_mask"].sum()) == 150  # 1.5 s of 10 ms mel frames
    assert float(inputs["video_second_per_grid"][0]) == 0.5  # 2 frames per grid at 4 fps

    prompt_length = inputs["input_ids"].shape[1]
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=8,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    response = out.sequences[:, prompt_length:]
    assert response.shape[1] == len(out.scores) >= 1
    sampled = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
    sampled = sampled.gather(-1, response[..., None])[..., 0]

    # Training forward: prompt + response with the very same processed media tensors.
    model.train()
    batch = dict(inputs)
    batch["input_ids"] = out.sequences
    batch["attention_mask"] = torch.ones_like(out.sequences)
    logits = model(**batch).logits[:, prompt_length - 1 : -1].float()
    banned = model.generation_config.suppress_tokens
    assert set(media_token_ids(processor.tokenizer)) <= set(banned)
    logits[..., banned] = float("-inf")  # the mask generation sampled under
    recomputed = torch.log_softmax(logits, -1).gather(-1, response[..., None])[..., 0]
    assert torch.allclose(recomputed.detach(), sampled, atol=1e-4, rtol=0)

    (-recomputed.sum()).backward()

    def without_grad(module: torch.nn.Module) -> list[str]:
        return [
            n
            for n, p in module.named_parameters()
            if p.grad is None or not bool(p.grad.abs().sum() > 0)
        ]

    assert without_grad(model.visual) == []
    # The only audio parameter the thinker never uses is the talker's bos/eos embedding.
    assert without_grad(model.audio_tower) == ["audio_bos_eos_token.weight"]


def test_same_seed_same_weights(omni_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_omni_model(tmp_path / "again", seed=0)
    other = build_tiny_omni_model(tmp_path / "other", seed=1)
    assert (again / "model.safetensors").read_bytes() == (
        omni_dir / "model.safetensors"
    ).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (
        omni_dir / "model.safetensors"
    ).read_bytes()


def test_kv_cached_decode_loop_matches_the_training_forward(omni_dir: Path) -> None:
    """The position contract an engine's own decode loop must keep for M-RoPE: prefill with no
    ``position_ids`` (the model computes 3-D positions and ``rope_deltas``), then each step at
    ``[3, batch, 1]`` = text position + ``rope_deltas``. Plain 1-D positions are off (~1e-3)."""
    processor = load_omni_processor(omni_dir)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni_dir).eval()
    banned = model.generation_config.suppress_tokens
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "video"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text, "padded " + text],  # rows of different lengths: left padding
        images=[draw_shapes(0)[0].numpy(), draw_shapes(1, size=90)[0].numpy()],
        audio=[tones(0)[0].numpy(), tones(1, seconds=0.5)[0].numpy()],
        videos=[moving_square(0)[0].numpy(), moving_square(1)[0].numpy()],
        return_tensors="pt",
        padding=True,
        **processor_kwargs(processor, fps=2.0),
    )
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    attention = inputs["attention_mask"]
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = [], []
    with torch.no_grad():
        out = model(
            input_ids=inputs["input_ids"], attention_mask=attention, use_cache=True, **media
        )
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        text_position = attention.sum(-1, keepdim=True)  # of the next token, padding excluded
        for _ in range(6):
            logits[:, banned] = float("-inf")
            step = torch.log_softmax(logits, -1)
            token = torch.multinomial(step.exp(), 1, generator=generator)
            tokens.append(token)
            logprobs.append(step.gather(-1, token))
            attention = torch.cat([attention, torch.ones_like(token)], 1)
            positions = (text_position + model.rope_deltas).unsqueeze(0).expand(3, -1, -1)
            out = model(
                input_ids=token,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1].float()
            text_position = text_position + 1
        response = torch.cat(tokens, 1)
        prompt_length = inputs["input_ids"].shape[1]
        full = (
            model(
                input_ids=torch.cat([inputs["input_ids"], response], 1),
                attention_mask=attention,
                **media,
            )
            .logits[:, prompt_length - 1 : -1]
            .float()
        )
    full[..., banned] = float("-inf")
    recomputed = torch.log_softmax(full, -1).gather(-1, response[..., None])[..., 0]
    assert torch.allclose(recomputed, torch.cat(logprobs, 1), atol=1e-4, rtol=0)
