"""Generation backends behind one interface (``GenerationEngine``), and offline model building.

    init = ModelInitConfig(arch="qwen2", hidden_size=64, num_layers=2, vocab_size=512)
    folder = build_tiny_model(init, "runs/model")      # a normal HF folder, tokenizer included
    engine = HFEngine.from_pretrained(folder)
    gens = await engine.generate([prompt_ids], max_new_tokens=32, stop_token_ids=[...], n=4)
    await engine.load_weights(1, trainer_state_dict)

This package sits on the engines floor: it imports torch, transformers, tokenizers and
``relax.errors``/``relax.config`` only.
"""

from __future__ import annotations

from relax.engines._base import (
    EngineError,
    FinishReason,
    Generation,
    GenerationEngine,
    SamplingParams,
    StateDict,
)
from relax.engines._hf import HFEngine
from relax.engines._models import (
    BYTE_TOKENIZER,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_byte_tokenizer,
    build_tiny_model,
    check_vocab,
    load_policy,
    load_tokenizer,
    pad_token_id,
    stop_token_ids,
    torch_dtype,
)
from relax.engines._select import open_engine

__all__ = [
    "BYTE_TOKENIZER",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "EngineError",
    "FinishReason",
    "Generation",
    "GenerationEngine",
    "HFEngine",
    "SamplingParams",
    "StateDict",
    "build_byte_tokenizer",
    "build_tiny_model",
    "check_vocab",
    "load_policy",
    "load_tokenizer",
    "open_engine",
    "pad_token_id",
    "stop_token_ids",
    "torch_dtype",
]
