"""Building tiny models offline and loading them like any checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.config import ModelInitConfig
from relax.errors import ConfigError
from relax.models import (
    build_byte_tokenizer,
    build_tiny_model,
    check_vocab,
    load_policy,
    torch_dtype,
)

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}
"""The tiny model of every engine test: 2 layers, hidden 64, vocab 512."""


@pytest.fixture(scope="module")
def tiny_init() -> ModelInitConfig:
    return ModelInitConfig(**TINY, seed=0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tiny_init: ModelInitConfig) -> Path:
    return build_tiny_model(tiny_init, tmp_path_factory.mktemp("tiny"))


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_build_save_load_same_logits(tiny_dir: Path, tiny_init: ModelInitConfig) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in tiny_dir.iterdir()
    }
    model, tokenizer = load_policy(tiny_dir, "float32")
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.training
    assert model.config.vocab_size == 512 and model.config.num_hidden_layers == 2
    # Re-initialise the model in memory the way build_tiny_model does (same config, same seed):
    # the saved-and-loaded copy must give the very same logits.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny_init.seed)
        reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    assert _logits(model, ids).shape == (len(ids), 512)


def test_seed_determinism(tmp_path: Path) -> None:
    a, _ = load_policy(build_tiny_model(ModelInitConfig(**TINY, seed=7), tmp_path / "a"))
    b, _ = load_policy(build_tiny_model(ModelInitConfig(**TINY, seed=7), tmp_path / "b"))
    c, _ = load_policy(build_tiny_model(ModelInitConfig(**TINY, seed=8), tmp_path / "c"))
    ids = [1, 2, 3, 257]
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    assert not torch.allclose(_logits(a, ids), _logits(c, ids))


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(ModelInitConfig(**TINY, seed=5), tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_llama_and_dtype(tmp_path: Path) -> None:
    folder = build_tiny_model(ModelInitConfig(**{**TINY, "arch": "llama"}), tmp_path)
    model, _ = load_policy(folder, "bfloat16")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.bfloat16
    assert torch_dtype("float16") == torch.float16


def test_vocab_too_small_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.init\.vocab_size.*261 tokens.*at least 261"):
        build_tiny_model(ModelInitConfig(**{**TINY, "vocab_size": 200}), tmp_path)
    assert not (tmp_path / "config.json").exists()
    check_vocab(261, build_byte_tokenizer())  # exactly enough is fine


def test_load_policy_rejects_a_non_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a model folder"):
        load_policy(tmp_path)


def test_pad_token_id_falls_back_to_eos_and_refuses_neither() -> None:
    from types import SimpleNamespace

    from relax.models import EngineError, pad_token_id

    assert pad_token_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    with pytest.raises(EngineError, match="neither a pad nor an EOS"):
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None), "/m")
