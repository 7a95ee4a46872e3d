"""Length-aware scheduling (``[rollout] schedule = "shortest_first"``): what a rollout expects
each prompt's responses to take, from what they took before.

In RL the long tail of response lengths decides step time: a batch is done when its longest
response is. A replica remembers, per prompt (by its token ids, so a prompt seen again in a
later epoch is recognised whatever its uid), the mean length of its group's responses, and
orders its next batches by it: the engine decodes similar lengths together, the shortest
first, and the groups reach the bus as they finish (``generate_groups``'s ``on_group``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from relax.roles._common import as_list
from relax.schema import PROMPT_IDS


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    """A short, process-independent key of a prompt's token ids."""
    digest = hashlib.blake2b(digest_size=12)
    for token in prompt_ids:
        digest.update(int(token).to_bytes(8, "little", signed=True))
    return digest.digest()


class LengthBook:
    """Expected response length per prompt: the mean length of its last group's responses.

    Bounded (least recently seen first out) so a long run over a huge dataset does not grow it
    without end; an unseen prompt is expected to take the mean of the prompts it holds.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._lengths: OrderedDict[bytes, float] = OrderedDict()
        self._total = 0.0  # sum of the held lengths: the mean without a scan
        self.observed = 0
        self.reordered = 0  # batches whose order the book changed

    def expected(self, prompt_ids: Sequence[int]) -> float | None:
        return self._lengths.get(prompt_key(prompt_ids))

    def observe(self, prompt_ids: Sequence[int], lengths: Sequence[int]) -> None:
        """Record the response lengths of one group of ``prompt_ids``."""
        if not lengths:
            return
        key = prompt_key(prompt_ids)
        old = self._lengths.pop(key, None)
        if old is not None:
            self._total -= old
        mean = sum(lengths) / len(lengths)
        self._lengths[key] = mean
        self._total += mean
        self.observed += 1
        while len(self._lengths) > self.capacity:
            _, dropped = self._lengths.popitem(last=False)
            self._total -= dropped

    def order(self, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``prompts`` (prompt rows) shortest expected first; a stable sort, so prompts with
        the same expectation (all of them, before anything was observed) keep their order."""
        if not self._lengths:
            return prompts
        default = self._total / len(self._lengths)
        expected = [self.expected(as_list(row["columns"][PROMPT_IDS])) for row in prompts]
        keys = [default if e is None else e for e in expected]
        order = sorted(range(len(prompts)), key=keys.__getitem__)
        if order != list(range(len(prompts))):
            self.reordered += 1
        return [prompts[i] for i in order]

    def statistics(self) -> dict[str, float | int]:
        held = len(self._lengths)
        return {
            "prompts": held,
            "observed_groups": self.observed,
            "reordered_batches": self.reordered,
            "mean_length": self._total / held if held else 0.0,
        }
