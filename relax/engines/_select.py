"""Choosing the generation engine a rollout replica serves with (``[rollout] engine``)."""

from __future__ import annotations

from pathlib import Path

from relax.config import LoraConfig, RolloutConfig
from relax.engines._base import GenerationEngine
from relax.engines._hf import HFEngine


def open_engine(
    rollout: RolloutConfig,
    model_dir: str | Path,
    dtype: str = "float32",
    *,
    lora: LoraConfig | None = None,
) -> GenerationEngine:
    """The engine ``rollout.engine`` names, loaded from the HF folder ``model_dir``; with
    ``lora`` (``[model.lora]``), it serves the adapters the trainer publishes.

    vLLM is imported only when chosen, so the CPU default never needs it installed.
    """
    if rollout.engine == "hf":
        return HFEngine.from_pretrained(
            model_dir,
            dtype,
            interruptible=rollout.interruptible,
            lora=lora,
            device=rollout.device,
        )
    from relax.engines._vllm import VLLMEngine

    return VLLMEngine.from_pretrained(
        model_dir, dtype, options=rollout.vllm, lora=lora, interruptible=rollout.interruptible
    )
