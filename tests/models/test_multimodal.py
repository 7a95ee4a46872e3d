"""Multimodal models without generation: the tiny Qwen2.5-Omni checkpoint ``build_tiny_model``
makes, loading omni checkpoints as their thinker, text folders staying text, and how a batch's
media collate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from relax.config import ModelInitConfig
from relax.models import (
    OMNI_TOKENS,
    EngineError,
    build_tiny_model,
    collate_mm_inputs,
    is_multimodal,
    load_policy,
    load_processor,
    suppressed_token_ids,
)
from tests.models.helpers import OMNI, build_omni, omni_dir_fixture, processor_fixture  # noqa: F401

# --------------------------------------------------------------------------- building, loading


def test_build_tiny_model_makes_an_omni_checkpoint(
    omni_dir: Path, tmp_path: Path, processor: Any
) -> None:
    names = {p.name for p in omni_dir.iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json"} <= names
    model, tokenizer = load_policy(omni_dir)
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert is_multimodal(omni_dir) and is_multimodal(model)
    text = model.config.get_text_config()
    assert (text.num_attention_heads, text.num_key_value_heads, text.intermediate_size) == (
        4,
        2,
        128,
    )
    assert text.vocab_size == len(tokenizer) == len(processor.tokenizer) == 268
    assert text.max_position_embeddings == 1024
    media_ids = {processor.tokenizer.convert_tokens_to_ids(t) for t in OMNI_TOKENS.values()}
    assert media_ids <= set(suppressed_token_ids(model))
    assert type(processor).__name__ == "Qwen2_5OmniProcessor"
    # The same init gives the same bytes; a wider decoder keeps the towers tiny.
    again = build_omni(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (
        omni_dir / "model.safetensors"
    ).read_bytes()
    wide = load_policy(
        build_tiny_model(ModelInitConfig(**{**OMNI, "hidden_size": 96}), tmp_path / "wide")
    )[0]
    assert wide.config.get_text_config().hidden_size == 96
    assert wide.visual.config.hidden_size == 64


def test_text_folders_stay_text(tmp_path: Path) -> None:
    folder = build_tiny_model(ModelInitConfig(hidden_size=32, num_layers=1), tmp_path / "text")
    assert not is_multimodal(folder) and load_processor(folder) is None
    model, _ = load_policy(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not is_multimodal(model) and suppressed_token_ids(model) == []


def test_a_full_omni_checkpoint_loads_as_its_thinker(omni_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    thinker, _ = load_policy(omni_dir)
    config = Qwen2_5OmniConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False)
    full = Qwen2_5OmniForConditionalGeneration(config)
    full.thinker.load_state_dict(thinker.state_dict())
    full.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((omni_dir / "tokenizer.json").read_bytes())
    loaded, _ = load_policy(tmp_path, tokenizer=omni_dir)
    assert type(loaded) is type(thinker)
    expected = thinker.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())


def test_collate_mm_inputs() -> None:
    a = {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    b = {
        "input_features": torch.ones(1, 2, 5),
        "feature_attention_mask": torch.ones(1, 5, dtype=torch.long),
    }
    c = {
        "pixel_values": torch.zeros(8, 3),
        "image_grid_thw": torch.tensor([[1, 2, 4]]),
        "input_features": torch.full((2, 2, 3), 2.0),
        "feature_attention_mask": torch.ones(2, 3, dtype=torch.long),
    }
    assert collate_mm_inputs([]) == {} and collate_mm_inputs([None, None]) == {}
    out = collate_mm_inputs([a, None, b, c, a])
    assert out["pixel_values"].tolist() == [[1.0] * 3] * 4 + [[0.0] * 3] * 8 + [[1.0] * 3] * 4
    assert out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2]]
    # Audio frames padded to the longest: features with 0, the mask with 0 (= padding).
    assert out["input_features"].shape == (3, 2, 5)
    assert out["feature_attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert out["input_features"][1:, :, 3:].abs().sum() == 0
    with pytest.raises(EngineError, match="cannot be batched"):
        collate_mm_inputs([a, {"pixel_values": torch.ones(2, 4)}])
