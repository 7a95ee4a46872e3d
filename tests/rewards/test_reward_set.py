"""RewardSet: weighting, failure isolation (raise, hang, NaN), and statistics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from relax.config import RewardConfig
from relax.rewards import RewardSet

pytestmark = pytest.mark.anyio

FIXTURES = "tests.rewards.fixture_fns:"


def build(*functions: dict[str, Any]) -> RewardSet:
    return RewardSet.from_config(RewardConfig(functions=list(functions)))


def py(name: str, fn: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "kind": "python", "target": FIXTURES + fn, **fields}


async def test_weighted_sum_and_components() -> None:
    rewards = build(
        {"name": "correct", "kind": "numeric", "weight": 1.0},
        {"name": "fmt", "kind": "regex", "pattern": "####", "weight": 0.5},
        {"name": "long", "kind": "length_penalty", "weight": 2.0, "options": {"max_len": 10}},
    )
    # max_len 10, cache 2: 9 tokens is halfway into the cache -> -0.5, times weight 2.
    result = await rewards.score("#### 7", {"answer": 7}, response_tokens=9)
    assert result.ok and result.reason is None and result.failures == {}
    assert result.components == {"correct": 1.0, "fmt": 1.0, "long": pytest.approx(-0.5)}
    assert result.reward == pytest.approx(1.0 + 0.5 - 1.0)
    result = await rewards.score("8", {"answer": 7}, response_tokens=3)
    assert result.reward == 0.0


async def test_negative_weight() -> None:
    rewards = build({"name": "bad_word", "kind": "regex", "pattern": "sorry", "weight": -2.0})
    assert (await rewards.score("sorry", {})).reward == -2.0


@pytest.mark.parametrize(
    ("fn", "kind", "reason"),
    [
        ("boom", "error", "python 'f': raised RuntimeError: verifier exploded"),
        ("async_boom", "error", "python 'f': raised ValueError: async verifier exploded"),
        ("returns_nan", "invalid", "python 'f': returned nan"),
        ("returns_inf", "invalid", "python 'f': returned -inf"),
        ("returns_text", "invalid", "python 'f': returned '1.0', not a number"),
        ("returns_none", "invalid", "python 'f': returned None, not a number"),
    ],
)
async def test_bad_verifier_fails_the_sample_with_a_reason(fn: str, kind: str, reason: str) -> None:
    rewards = build(py("f", fn), {"name": "ok", "kind": "regex", "pattern": "x"})
    result = await rewards.score("x", {})
    assert not result.ok and result.reward is None
    assert result.reason == reason
    assert result.failures == {"f": kind}
    assert result.components == {"ok": 1.0}  # the healthy function still reports its score
    stats = rewards.statistics()
    assert stats["failed_samples"] == 1
    assert stats["functions"]["f"]["failures"] == {kind: 1}


async def test_sync_hang_times_out_without_blocking_the_loop() -> None:
    rewards = build(py("slow", "sleeps", timeout=0.2, options={"seconds": 1.0}))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    result = await rewards.score("x", {})
    elapsed = time.perf_counter() - start
    task.cancel()
    assert not result.ok and result.reason == "python 'slow': timed out after 0.2s"
    assert result.failures == {"slow": "timeout"}
    assert 0.19 <= elapsed < 0.6
    assert ticks >= 5  # the loop kept running while the thread slept
    stats = rewards.statistics()
    assert stats["abandoned_threads"] == 1 and stats["abandoned_alive"] == 1
    assert stats["functions"]["slow"]["failures"] == {"timeout": 1}


async def test_async_hang_times_out() -> None:
    rewards = build(py("slow", "async_sleeps", timeout=0.2))
    start = time.perf_counter()
    result = await rewards.score("x", {})
    assert time.perf_counter() - start < 0.6
    assert not result.ok and result.reason == "python 'slow': timed out after 0.2s"
    assert rewards.statistics()["abandoned_threads"] == 0


async def test_coroutine_that_ignores_cancellation_cannot_hang_score() -> None:
    rewards = build(py("stubborn", "ignores_cancellation", timeout=0.1))
    start = time.perf_counter()
    result = await rewards.score("x", {})
    assert time.perf_counter() - start < 0.35
    assert result.failures == {"stubborn": "timeout"}
    await asyncio.sleep(0.5)  # let the abandoned task finish inside this test's loop


async def test_functions_run_concurrently() -> None:
    # Two 0.3 s sleeps under a 1 s timeout finish together, not one after the other.
    rewards = build(
        py("a", "sleeps", timeout=1.0, options={"seconds": 0.3}),
        py("b", "sleeps", timeout=1.0, options={"seconds": 0.3}),
    )
    start = time.perf_counter()
    result = await rewards.score("x", {})
    assert result.ok and result.reward == 2.0
    assert time.perf_counter() - start < 0.55


async def test_several_failures_are_all_named() -> None:
    rewards = build(py("a", "boom"), py("b", "returns_nan"))
    result = await rewards.score("x", {})
    assert result.failures == {"a": "error", "b": "invalid"}
    assert result.reason == (
        "python 'a': raised RuntimeError: verifier exploded; python 'b': returned nan"
    )


async def test_overflowing_weighted_sum_fails() -> None:
    rewards = build(
        {"name": "a", "kind": "regex", "pattern": "x", "weight": 1e308},
        {"name": "b", "kind": "regex", "pattern": "x", "weight": 1e308},
    )
    result = await rewards.score("x", {})
    assert not result.ok and "not finite" in (result.reason or "")


async def test_statistics_counts() -> None:
    rewards = build(
        {"name": "num", "kind": "numeric"},
        py("flaky", "contains_keyword", options={"keyword": "x"}),
    )
    await rewards.score("1", {"answer": 1})
    await rewards.score("2", {"answer": 1})
    await rewards.score("3", {})  # numeric has no reference: error
    stats = rewards.statistics()
    assert stats["samples"] == 3 and stats["failed_samples"] == 1
    num, flaky = stats["functions"]["num"], stats["functions"]["flaky"]
    assert num["calls"] == 3 and num["failures"] == {"error": 1}
    assert flaky["calls"] == 3 and flaky["failures"] == {}
    assert 0 < num["mean_latency_s"] <= num["max_latency_s"] < 1
    assert flaky["mean_latency_s"] > 0


def test_names_must_be_unique() -> None:
    from relax.config import RewardFunctionConfig
    from relax.rewards import build_verifier

    verifier = build_verifier(RewardFunctionConfig(name="a", kind="exact_match"))
    with pytest.raises(ValueError, match="unique"):
        RewardSet([verifier, verifier])


async def test_inline_overrun_is_marked_timed_out_after_the_fact() -> None:
    # Inline verifiers cannot be interrupted (see _verifiers' docstring); one that overruns
    # its timeout anyway must not count as a success.
    from relax.config import RewardFunctionConfig
    from relax.rewards import BuildContext, Verifier

    class Slow(Verifier):
        kind = "slow"

        def __call__(self, response: str, sample: Any, response_tokens: int | None) -> float:
            time.sleep(0.15)
            return 1.0

    config = RewardFunctionConfig(name="s", kind="exact_match", timeout=0.05)
    rewards = RewardSet([Slow(config, BuildContext())])
    result = await rewards.score("x", {})
    assert result.reason == "slow 's': timed out after 0.05s"
