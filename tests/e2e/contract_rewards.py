"""Reward functions for the reward-contract tests (``kind = "python"``, by import path)."""

from __future__ import annotations

import asyncio
import json
import zlib

from relax.rewards import Sample


def always_raises(response: str, sample: Sample) -> float:
    """A reward function with a bug: it fails on every sample."""
    return len(response) / 0  # the user's bug: ZeroDivisionError on every call


async def components(response: str, sample: Sample, *, log: str) -> dict[str, float]:
    """Async, returns named components, and records what it was given (one JSON line)."""
    await asyncio.sleep(0)
    record = {
        "keys": sorted(sample),
        "answer": sample.answer,
        "fields": sample.fields,
        "prompt": sample.prompt,
        "messages": sample.messages,
        "response": sample.response,
        "response_ids": sample.response_ids,
        "prompt_ids": sample.prompt_ids,
        "uid": sample.uid,
        "group": sample.group,
        "is_sample": isinstance(sample, Sample),
    }
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
    return {
        "starts_digit": float(response[:1].isdigit()),
        "length": float(len(sample.response_ids)),
    }


def batched_sum(responses: list[str], samples: list[Sample], *, log: str) -> list[float]:
    """Batched: one call for the batch; scores each sample by whether its row's own
    ``operands`` field adds up to its answer (always, for examples/own_reward's rows)."""
    with open(log, "a") as f:
        f.write(json.dumps({"batch": len(samples), "uids": [s.uid for s in samples]}) + "\n")
    return [float(sum(s["operands"]) == s.answer) for s in samples]


def fails_for_some_prompts(response: str, sample: Sample) -> float:
    """A flaky reward: raises for about one prompt in eight (the same prompts every run, so the
    groups a run drops are known), else whether the response starts with a digit."""
    if zlib.crc32(sample.group.encode()) % 8 == 0:
        raise RuntimeError(f"the reward service failed for {sample.group}")
    return float(response[:1].isdigit())
