"""Tiny random-init models built offline from ``[model.init]``: a cluster needs no model hub.

``build_tiny_model(init, directory)`` saves a seeded Qwen2, Llama or Qwen3-MoE causal LM next
to the byte tokenizer, so the folder is an ordinary Hugging Face checkpoint (loadable by ``from_pretrained``,
``load_policy`` and vLLM). ``arch = "qwen2_5_omni"`` builds a tiny Qwen2.5-Omni thinker and its
processor instead (``relax.models._omni``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3MoeConfig,
)

from relax.config import ModelInitConfig
from relax.errors import ConfigError, ConfigIssue
from relax.models._build import one_build_at_a_time
from relax.models._omni import OMNI_ARCHS, build_tiny_omni
from relax.models._tokenizers import build_byte_tokenizer, check_vocab, stop_token_ids


def _model_config(init: ModelInitConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
    common: dict[str, Any] = {
        "vocab_size": init.vocab_size,
        "hidden_size": init.hidden_size,
        "num_hidden_layers": init.num_layers,
        "num_attention_heads": init.num_heads,
        "num_key_value_heads": init.num_kv_heads,
        "intermediate_size": init.intermediate_size,
        "max_position_embeddings": init.max_position_embeddings,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        # Untied: the RL update of the output head should not move the input embeddings too.
        "tie_word_embeddings": False,
    }
    if init.arch == "qwen2":
        return Qwen2Config(**common)
    if init.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=init.hidden_size // init.num_heads,
            num_experts=init.num_experts,
            num_experts_per_tok=init.num_experts_per_tok,
            moe_intermediate_size=init.moe_intermediate_size or init.intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,  # every block is a mixture of experts
        )
    return LlamaConfig(**common)


def build_tiny_model(
    init: ModelInitConfig,
    directory: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Build a seeded random-init causal LM from ``[model.init]`` and save it to ``directory``.

    The folder holds ``config.json``, ``generation_config.json``, safetensors weights and the
    tokenizer (the byte tokenizer unless one is given), so ``load_policy`` — and vLLM — load it
    like any checkpoint. The same ``init`` (seed included) always gives the same weights, and
    the global torch RNG is left untouched.

    ``arch = "qwen2_5_omni"`` builds a Qwen2.5-Omni thinker instead (text decoder of these sizes,
    tiny vision and audio towers; vocabulary = its tokenizer's, ``vocab_size`` unused) and saves
    its processor too (see ``relax.models._omni``); ``load_processor`` loads it.
    ``arch = "qwen3_omni_moe"`` likewise, a Qwen3-Omni-MoE thinker (MoE text decoder).
    """
    if init.arch in OMNI_ARCHS:
        if tokenizer is not None:
            raise ConfigError(
                [
                    ConfigIssue(
                        "model.tokenizer",
                        f"cannot be set with model.init.arch = {init.arch!r}, which builds its"
                        " own tokenizer (the byte tokenizer plus the media tokens)",
                    )
                ]
            )
        return build_tiny_omni(init, directory)
    tokenizer = (
        tokenizer if tokenizer is not None else build_byte_tokenizer(init.max_position_embeddings)
    )
    check_vocab(init.vocab_size, tokenizer)
    config = _model_config(init, tokenizer)
    with torch.random.fork_rng(devices=[]), one_build_at_a_time():
        torch.manual_seed(init.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_token_ids(tokenizer),
    )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
