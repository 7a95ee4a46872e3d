"""The prompts of this recipe: one-digit additions whose rows carry fields of their own.

A prompt generator yields records; ``id``, ``prompt`` and ``answer`` are what Relax needs, and
every other field (here ``operands`` and ``carry``) reaches the reward function with its JSON
type (``sample["operands"]`` is a list of two ints, ``sample.answer`` an int).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any


def additions(seed: int = 0) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for index in itertools.count():
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        yield {
            "id": f"add-{seed}-{index}",
            "prompt": f"{a}+{b}=",
            "answer": a + b,
            "operands": [a, b],
            "carry": a + b >= 10,
        }
