"""Choosing the generation engine a rollout replica serves with (``[rollout] engine``)."""

from __future__ import annotations

from pathlib import Path

from relax.config import RolloutConfig
from relax.engines._base import GenerationEngine
from relax.engines._hf import HFEngine


def open_engine(
    rollout: RolloutConfig, model_dir: str | Path, dtype: str = "float32"
) -> GenerationEngine:
    """The engine ``rollout.engine`` names, loaded from the HF folder ``model_dir``.

    vLLM is imported only when chosen, so the CPU default never needs it installed.
    """
    if rollout.engine == "hf":
        return HFEngine.from_pretrained(model_dir, dtype, interruptible=rollout.interruptible)
    from relax.engines._vllm import VLLMEngine

    return VLLMEngine.from_pretrained(model_dir, dtype, options=rollout.vllm)
