"""Tiny Qwen2 models built on the spot (no download) and rows scored by them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

VOCAB = 64
PAD = 0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Qwen2 saved once per session."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(path)
    return path


@pytest.fixture
def load_model(tiny_model_dir: Path):
    """A factory returning a fresh copy of the tiny model each call."""

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    return load


def make_rows(
    n_groups: int = 2, per_group: int = 2, seed: int = 0, model: torch.nn.Module | None = None
) -> list[dict]:
    """Rows with prompts and responses of different lengths, rewards 0/1 within each group.

    With ``model`` the rollout log-probs are the model's own (on-policy); otherwise random.
    """
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        for i in range(per_group):
            response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 8))]
            rows.append(
                {
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "logprobs": [-rng.uniform(2.0, 6.0) for _ in response],
                    "reward": float(i % 2),
                    "group": f"g{g}",
                }
            )
    if model is not None:
        from relax.training import pack_batch, response_values, sequence_logprobs

        with torch.no_grad():
            batch = pack_batch(rows, PAD)
            own = response_values(batch, sequence_logprobs(model, batch))
        for row, lp in zip(rows, own, strict=True):
            row["logprobs"] = lp
    return rows
