"""Generation backends behind one interface (``GenerationEngine``), and choosing one.

    folder = build_tiny_model(init, "runs/model")      # relax.models: building and loading
    engine = HFEngine.from_pretrained(folder)           # or open_engine(cfg.rollout, folder)
    params = SamplingParams(max_new_tokens=32, stop_token_ids=[...], n=4)
    gens = await engine.generate([prompt_ids], params)
    await engine.load_weights(1, trainer_state_dict)

Multimodal (a Qwen2.5-Omni/-VL folder): ``engine.generate([ids], params, mm_inputs=[media])``
samples with the media tensors of ``relax.models.load_processor``'s processor.

Models, tokenizers, processors and media collation live in ``relax.models`` (``load_policy``,
``load_tokenizer``, ``build_tiny_model``, ``collate_mm_inputs``, ``suppressed_token_ids``, …);
this package holds generation only. It imports torch, transformers, ``relax.models`` and
``relax.errors``/``relax.config`` (vLLM only when chosen).
"""

from __future__ import annotations

from relax.engines._base import (
    EngineError,
    FinishReason,
    Generation,
    GenerationEngine,
    MediaInputs,
    OnFinished,
    OnToken,
    SamplingParams,
    StateDict,
    TokenEvent,
)
from relax.engines._hf import HFEngine
from relax.engines._select import open_engine

__all__ = [
    "EngineError",
    "FinishReason",
    "Generation",
    "GenerationEngine",
    "HFEngine",
    "MediaInputs",
    "OnFinished",
    "OnToken",
    "SamplingParams",
    "StateDict",
    "TokenEvent",
    "open_engine",
]
