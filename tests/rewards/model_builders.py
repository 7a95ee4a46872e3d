"""Tiny models for the model-backed reward kinds, built on the spot and saved like any
checkpoint (``save_pretrained``), so the code under test loads them through ``from_pretrained``.

- ``random_reward_model``: a random-init Qwen2 sequence classifier (one label) — its scores mean
  nothing, but every score can be recomputed by an independent forward pass.
- ``bigram_judge``: a causal LM wired by hand so that its greedy reply depends only on the last
  token of its prompt: a digit ``d`` is followed by ``d`` again (reply "777" after a 7), anything
  else by ``x`` ("xxx", which holds no score). A judge whose every answer is known in advance.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

from relax.models import build_byte_tokenizer, load_tokenizer

DIGITS = [ord(str(d)) for d in range(10)]


def _config(tokenizer, **sizes) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **sizes,
    )


def random_reward_model(folder: Path, *, num_labels: int = 1, seed: int = 0) -> Path:
    tokenizer = build_byte_tokenizer()
    config = _config(
        tokenizer,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bigram_judge(folder: Path) -> Path:
    tokenizer = build_byte_tokenizer()
    vocab = len(tokenizer)
    hidden = 264  # >= vocab: each token gets its own axis
    config = _config(
        tokenizer,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=8,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Attention and MLP add nothing to the residual stream, so the last hidden state is
        # the current token's embedding: one axis per token, read back by the output head.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, :vocab] = torch.eye(vocab)
        head = model.lm_head.weight
        head.zero_()
        for token in range(vocab):
            follower = token if token in DIGITS else ord("x")
            head[follower, token] = 1.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def independent_scores(folder: Path, texts: list[str], max_length: int = 10_000) -> list[float]:
    """Each text alone through a separately loaded copy of the model."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = load_tokenizer(folder)
    scores = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"][:, -max_length:]
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores
