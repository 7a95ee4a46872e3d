"""Train the tiny reward model the `reward_model` recipe scores with (a few seconds on a CPU).

    python examples/reward_model/train_rm.py            # writes runs/reward_model/rm

It is a Qwen2 sequence-classification model (one label) on the byte tokenizer, trained to give
"a+b=" + response the score 1 when the response starts with a digit and 0 otherwise (mean
squared error on its logit): the digits task's rule, learnt from labelled examples instead of
written down. Negatives are what the recipe's random policy writes at first (random byte
tokens), positives the same with a digit first. Seeded, and the global torch RNG is left alone,
so the same seed gives the same folder.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config

from relax.models import build_byte_tokenizer

DEFAULT_FOLDER = Path("runs/reward_model/rm")
"""Where ``python examples/reward_model/train_rm.py`` writes (the recipe's model.path)."""

_GOOD = re.compile(r"^[0-9]")
_RESPONSE_TOKENS = 3  # the recipe's rollout.max_new_tokens


def label(response: str) -> float:
    """What the reward model learns: 1.0 for a response that starts with a digit, else 0.0."""
    return 1.0 if _GOOD.match(response) else 0.0


def examples(rng: random.Random, tokenizer, count: int) -> list[tuple[str, float]]:
    """``count`` (prompt + response text, label) pairs, half of them good."""
    pairs = []
    for index in range(count):
        prompt = f"{rng.randint(0, 9)}+{rng.randint(0, 9)}="
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, _RESPONSE_TOKENS))]
        if index % 2 == 0:
            ids[0] = ord(str(rng.randint(0, 9)))
        response = tokenizer.decode(ids, skip_special_tokens=True)
        pairs.append((prompt + response, label(response)))
    return pairs


def build_reward_model(
    folder: str | Path = DEFAULT_FOLDER, *, seed: int = 0, steps: int = 150
) -> Path:
    """Train the tiny digit reward model and save it (weights + tokenizer) to ``folder``."""
    folder = Path(folder)
    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    # One thread: ops this small only lose time to thread hand-offs (70x on a busy 2-core box).
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _train(config, tokenizer, rng, steps)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _train(config: Qwen2Config, tokenizer, rng: random.Random, steps: int):
    """A freshly initialised model fitted to ``steps`` batches of labelled examples."""
    model = AutoModelForSequenceClassification.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        texts, labels = zip(*examples(rng, tokenizer, 64), strict=True)
        batch = tokenizer(list(texts), padding=True, return_tensors="pt", padding_side="right")
        logits = model(**batch).logits[:, 0]
        loss = torch.nn.functional.mse_loss(logits, torch.tensor(labels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


if __name__ == "__main__":
    print(build_reward_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_FOLDER))
