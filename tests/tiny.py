"""The tiny cluster the whole-cluster tests run: a 1-layer, hidden-32 Qwen2 built from
``[model.init]``, groups of 4 samples, short responses, one 8-sample batch per step."""

from __future__ import annotations

from pathlib import Path

MODEL_INIT = """[model.init]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
vocab_size = 261
"""
"""The tiny policy model, built from scratch (no model folder needed)."""


def tiny_toml(
    name: str,
    *,
    staleness: int | str = 1,
    steps: int = 100_000,
    max_new_tokens: int = 4,
    lr: float | None = None,
    lease_timeout: float | None = None,
    model: str = MODEL_INIT,
    cluster: str = "",
    data: str = "",
    rollout: str = "",
    reward: str = "",
    trainer: str = "",
    extra: str = "",
) -> str:
    """The text of a tiny ``cluster.toml`` for a cluster called ``name``.

    ``staleness`` is a number or ``"inf"``; ``steps`` defaults to "until stopped". ``lr`` and
    ``lease_timeout`` are left at their defaults unless given. ``cluster``, ``data``, ``rollout``,
    ``reward`` and ``trainer`` are extra lines for those tables (e.g. ``'placement = "process"'``);
    ``model`` replaces the ``[model.init]`` table; ``extra`` is appended (whole tables).
    """
    bound = '"inf"' if staleness == "inf" else staleness
    lines = [
        f"staleness = {bound}",
        "[cluster]",
        f'name = "{name}"',
        cluster,
        model,
        "[data]",
        "n_samples_per_prompt = 4",
        data,
        "[rollout]",
        f"max_new_tokens = {max_new_tokens}",
        "batch_size = 2",
        rollout,
    ]
    if reward:
        lines += ["[reward]", reward]
    if lease_timeout is not None:
        lines += ["[bus]", f"lease_timeout = {lease_timeout}"]
    lines += [
        "[trainer]",
        f"steps = {steps}",
        "global_batch_size = 8",
        "micro_batch_size = 8",
        *([f"lr = {lr}"] if lr is not None else []),
        trainer,
        extra,
    ]
    return "\n".join(line for line in lines if line) + "\n"


def spread_lengths(model_dir: Path, scale: float = 30.0, seed: int = 0) -> Path:
    """Give the policy saved in ``model_dir`` responses of widely spread lengths: its
    end-of-sequence row of the output layer becomes a large random direction, so whether it
    stops depends strongly on the state (a random-init model otherwise almost never stops:
    every response runs to ``max_new_tokens``). Saved in place, loaded like any checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from relax.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    eos = load_tokenizer(model_dir).eos_token_id
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        weight[eos] = torch.randn(weight.shape[1], generator=g) * weight.std() * scale
    model.save_pretrained(model_dir)
    return model_dir
