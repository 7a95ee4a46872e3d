"""Generation backends behind one interface (``GenerationEngine``), and offline model building.

    init = ModelInitConfig(arch="qwen2", hidden_size=64, num_layers=2, vocab_size=512)
    folder = build_tiny_model(init, "runs/model")      # a normal HF folder, tokenizer included
    engine = HFEngine.from_pretrained(folder)
    gens = await engine.generate([prompt_ids], max_new_tokens=32, stop_token_ids=[...], n=4)
    await engine.load_weights(1, trainer_state_dict)

Multimodal (``ModelInitConfig(arch="qwen2_5_omni")`` or a Qwen2.5-Omni/-VL folder):
``load_processor(folder)`` turns text + media into ``input_ids`` and media tensors;
``engine.generate([ids], ..., mm_inputs=[media])`` samples with them; ``collate_mm_inputs``
batches media the same way for a training forward, and ``suppressed_token_ids(model)`` are the
ids both sides mask (the media placeholders).

This package sits on the engines floor: it imports torch, transformers, tokenizers and
``relax.errors``/``relax.config`` only.
"""

from __future__ import annotations

from relax.engines._base import (
    EngineError,
    FinishReason,
    Generation,
    GenerationEngine,
    OnToken,
    SamplingParams,
    StateDict,
    TokenEvent,
)
from relax.engines._hf import HFEngine, MediaInputs
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
from relax.engines._multimodal import (
    collate_mm_inputs,
    is_multimodal,
    load_processor,
    processor_kwargs,
    suppressed_token_ids,
)
from relax.engines._select import open_engine
from relax.engines._video_processor import enable_video_without_torchvision

__all__ = [
    "BYTE_TOKENIZER",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "EngineError",
    "FinishReason",
    "Generation",
    "GenerationEngine",
    "HFEngine",
    "MediaInputs",
    "OnToken",
    "SamplingParams",
    "StateDict",
    "TokenEvent",
    "build_byte_tokenizer",
    "build_tiny_model",
    "check_vocab",
    "collate_mm_inputs",
    "enable_video_without_torchvision",
    "is_multimodal",
    "load_policy",
    "load_processor",
    "load_tokenizer",
    "open_engine",
    "pad_token_id",
    "processor_kwargs",
    "stop_token_ids",
    "suppressed_token_ids",
    "torch_dtype",
]
