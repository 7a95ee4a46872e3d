"""Reward functions for the contract tests ("tests.rewards.contract_fns:name")."""

from __future__ import annotations

import asyncio
import math

from relax.rewards import Sample

CALLS: list[int] = []


def echo_sample(response: str, sample: Sample) -> dict[str, float]:
    """One component per property of the contract that held."""
    return {
        "is_sample": float(isinstance(sample, Sample) and sample.response == response),
        "dict_answer": float(sample.answer == {"value": 5, "unit": "cm"}),
        "fields": float(sample["level"] == 5 and sample.fields["tags"] == ["a", "b"]),
        "ids": float(sample.prompt_ids == [1, 2, 3] and sample.response_ids == [4, 5]),
    }


def batched_level(responses: list[str], samples: list[Sample]) -> list[float]:
    CALLS.append(len(samples))
    assert [s.response for s in samples] == responses
    return [float(s["level"]) for s in samples]


async def async_batched(responses: list[str], samples: list[Sample]) -> list[float]:
    await asyncio.sleep(0)
    return [s["level"] / 2 for s in samples]


def batched_wrong_length(responses: list[str], samples: list[Sample]) -> list[float]:
    return [1.0, 1.0]


def batched_raises(responses: list[str], samples: list[Sample]) -> list[float]:
    raise RuntimeError("model server down")


def batched_one_nan(responses: list[str], samples: list[Sample]) -> list[float]:
    return [1.0, math.nan, 0.0]


def batched_not_a_list(responses: list[str], samples: list[Sample]) -> float:
    return 1.0


def components(response: str, sample: Sample) -> dict[str, float]:
    return {"correct": 1.0, "format": 0.5, "length": float(len(response))}


def empty_dict(response: str, sample: Sample) -> dict[str, float]:
    return {}


def dict_with_nan(response: str, sample: Sample) -> dict[str, float]:
    return {"ok": 1.0, "bad": math.nan}


def dict_with_text(response: str, sample: Sample) -> dict[str, object]:
    return {"bad": "1"}


def raises(response: str, sample: Sample) -> float:
    return sample["no such field"]


def one_argument(response: str) -> float:
    return 0.0
