"""`rollout.stop` strings end a response after the token that completes one (kept)."""

from __future__ import annotations

from typing import Any

import pytest

from relax.config import parse_config
from relax.engines import Generation, GenerationEngine, SamplingParams
from relax.models import build_byte_tokenizer
from relax.roles._rollout import generate_groups
from tests.tiny import tiny_toml

pytestmark = pytest.mark.anyio


class Scripted(GenerationEngine):
    """Answers every prompt with the same bytes (ids = byte values of the byte tokenizer)."""

    def __init__(self, text: str) -> None:
        self.tokenizer = build_byte_tokenizer()
        self.ids = list(text.encode())

    @property
    def version(self) -> int:
        return 3

    async def generate(self, prompts: Any, params: SamplingParams, **_: Any) -> list[Generation]:
        n = params.n
        return [
            Generation(
                list(p),
                list(self.ids),
                [-0.5] * len(self.ids),
                "length",
                3,
                i % n,
                token_versions=[3] * len(self.ids),
            )
            for p in prompts
            for i in range(n)
        ]

    async def load_weights(self, version: int, state_dict: Any) -> None:
        raise NotImplementedError

    def statistics(self) -> dict[str, float | int]:
        return {}


def rows() -> list[dict[str, Any]]:
    return [{"uid": "p0", "columns": {"prompt_ids": [1, 2]}}]


async def test_stop_string_cuts_after_its_last_token() -> None:
    cfg = parse_config(tiny_toml("stop", rollout='stop = ["=7", "zz"]'))
    gens = await generate_groups(Scripted("1+6=7 and more"), cfg, rows(), [])
    assert len(gens) == 4
    for g in gens:
        assert bytes(g.response_ids).decode() == "1+6=7"  # the stop string is kept
        assert g.finish_reason == "stop"
        assert len(g.logprobs) == len(g.token_versions) == 5


async def test_no_stop_string_leaves_the_response_alone() -> None:
    cfg = parse_config(tiny_toml("nostop", rollout='stop = ["zz"]'))
    (g, *_) = await generate_groups(Scripted("1+6=7 and more"), cfg, rows(), [])
    assert bytes(g.response_ids).decode() == "1+6=7 and more" and g.finish_reason == "length"
