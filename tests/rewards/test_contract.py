"""The reward contract: what a function receives (``Sample``), batched and async functions,
named components, signature checks at build time, and the ``math`` verifier."""

from __future__ import annotations

import json
from typing import Any

import pytest

from relax.config import RewardConfig
from relax.errors import ConfigError
from relax.rewards import RewardSet, Sample

pytestmark = pytest.mark.anyio

FNS = "tests.rewards.contract_fns:"


def reward_set(*functions: dict[str, Any]) -> RewardSet:
    return RewardSet.from_config(RewardConfig(functions=list(functions)))


def sample(i: int = 0, **fields: Any) -> Sample:
    return Sample(
        response=f"answer {i}",
        answer={"value": i, "unit": "cm"},
        fields={"level": i, "tags": ["a", "b"], **fields},
        prompt="What is it?",
        messages=[{"role": "user", "content": "What is it?"}],
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        response_tokens=2,
        uid=f"p-{i}/0",
        group=f"p-{i}",
    )


def test_sample_is_a_dict_with_typed_attributes() -> None:
    s = sample(3, uid="row's own uid")
    assert s.answer == {"value": 3, "unit": "cm"} and s["answer"] is s.answer
    assert s["level"] == 3 and s.fields["tags"] == ["a", "b"]
    assert s.uid == s["uid"] == "p-3/0"  # a standard key wins over a row field...
    assert s.fields["uid"] == "row's own uid"  # ...which the row keeps
    assert (s.prompt, s.response, s.group, s.response_tokens) == (
        "What is it?",
        "answer 3",
        "p-3",
        2,
    )
    assert json.loads(json.dumps(s))["answer"] == {"value": 3, "unit": "cm"}
    copy = s.copy()
    copy["level"] = 99
    copy.fields["tags"].append("c")  # the same list object: a shallow copy of the row
    copy.fields["new"] = 1
    assert s["level"] == 3 and "new" not in s.fields
    assert Sample.of("x", {"answer": "7", "extra": 1}).fields == {"extra": 1}


async def test_python_function_gets_the_whole_sample() -> None:
    rewards = reward_set({"name": "f", "kind": "python", "target": FNS + "echo_sample"})
    result = await rewards.score_batch([sample(5)])
    assert result[0].ok, result[0].reason
    seen = result[0].components
    # echo_sample scores 1.0 per check that held (see contract_fns)
    assert seen == {"f/is_sample": 1.0, "f/dict_answer": 1.0, "f/fields": 1.0, "f/ids": 1.0}


async def test_batched_function_is_called_once_per_batch() -> None:
    from tests.rewards import contract_fns

    contract_fns.CALLS.clear()
    rewards = reward_set(
        {"name": "rm", "kind": "python", "target": FNS + "batched_level", "batched": True},
        {"name": "exact", "kind": "exact_match", "options": {"answer_key": "gold"}},
    )
    batch = [sample(i, gold=f"answer {i}" if i % 2 else "no") for i in range(5)]
    results = await rewards.score_batch(batch)
    assert contract_fns.CALLS == [5]  # one call, the whole batch
    assert [r.reward for r in results] == [0.0, 2.0, 2.0, 4.0, 4.0]
    assert results[1].components == {"rm": 1.0, "exact": 1.0}


async def test_async_batched_function() -> None:
    rewards = reward_set(
        {"name": "rm", "kind": "python", "target": FNS + "async_batched", "batched": True}
    )
    results = await rewards.score_batch([sample(i) for i in range(3)])
    assert [r.reward for r in results] == [0.0, 0.5, 1.0]


@pytest.mark.parametrize(
    ("target", "reasons"),
    [
        ("batched_wrong_length", ["returned 2 scores for 3 samples"] * 3),
        ("batched_raises", ["raised RuntimeError: model server down"] * 3),
        ("batched_one_nan", [None, "returned nan", None]),
        ("batched_not_a_list", ["returned a float, not a list of 3 scores"] * 3),
    ],
)
async def test_batched_function_failures(target: str, reasons: list[str | None]) -> None:
    rewards = reward_set({"name": "rm", "kind": "python", "target": FNS + target, "batched": True})
    results = await rewards.score_batch([sample(i) for i in range(3)])
    for result, reason in zip(results, reasons, strict=True):
        if reason is None:
            assert result.ok, result.reason
        else:
            assert not result.ok and reason in str(result.reason), result.reason


async def test_dict_components_are_named_and_summed_by_weight() -> None:
    rewards = reward_set(
        {
            "name": "judge",
            "kind": "python",
            "target": FNS + "components",
            "weight": 2.0,
            "components": {"correct": 1.0, "format": 0.25},
        },
        {"name": "fmt", "kind": "regex", "pattern": "^answer", "weight": -1.0},
    )
    result = await rewards.score("answer 1", {"answer": "1"})
    assert result.ok, result.reason
    assert result.components == {
        "judge/correct": 1.0,
        "judge/format": 0.5,
        "judge/length": 8.0,  # not listed: weighs 1
        "fmt": 1.0,
    }
    assert result.reward == 2.0 * (1.0 + 0.25 * 0.5 + 8.0) - 1.0


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("empty_dict", "returned an empty dict"),
        ("dict_with_nan", "component 'bad' returned nan"),
        ("dict_with_text", "component 'bad' returned '1', not a number"),
    ],
)
async def test_bad_components_fail_the_sample(target: str, reason: str) -> None:
    rewards = reward_set({"name": "f", "kind": "python", "target": FNS + target})
    result = await rewards.score("x", {})
    assert not result.ok and reason in str(result.reason), result.reason


async def test_a_raising_function_keeps_its_exception_from_the_users_frame() -> None:
    rewards = reward_set({"name": "f", "kind": "python", "target": FNS + "raises"})
    result = await rewards.score("x", {})
    error = result.errors["f"]
    assert isinstance(error, KeyError)
    # The traceback starts in the user's function, not in our plumbing.
    assert error.__traceback__.tb_frame.f_code.co_name == "raises"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"target": FNS + "one_argument"}, "cannot be called as fn(response, sample)"),
        (
            {"target": FNS + "batched_level", "options": {"nope": 1}},
            "cannot be called as fn(response, sample, **options)",
        ),
        ({"target": FNS + "one_argument", "batched": True}, "fn(responses, samples)"),
    ],
)
def test_signature_is_checked_when_the_set_is_built(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        reward_set({"name": "f", "kind": "python", **fields})
    issue = info.value.issues[0]
    assert issue.path == "reward.functions[0].target" and message in issue.message, issue


def test_batched_is_only_for_python() -> None:
    with pytest.raises(ValueError, match='batched: only kind "python" can be batched'):
        RewardConfig(functions=[{"name": "f", "kind": "exact_match", "batched": True}])


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        ("\\boxed{0.5}", "$\\frac{1}{2}$", 1.0),  # the issue's example
        ("The answer is $\\boxed{\\frac{2}{4}}$.", "\\frac{1}{2}", 1.0),
        ("So it is 0.5", "1/2", 1.0),
        ("The answer is \\boxed{42}.", 42, 1.0),  # a JSON number reference
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("$\\boxed{\\pi}$", "\\pi", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
        ("I think 41", "42", 0.0),
        ("\\boxed{1/3}", "0.5", 0.0),
        ("no answer here", "42", 0.0),
    ],
)
async def test_math_verifier_on_real_answers(
    response: str, reference: Any, expected: float
) -> None:
    rewards = reward_set({"name": "math", "kind": "math"})
    result = await rewards.score(response, {"answer": reference})
    assert result.ok, result.reason
    assert result.reward == expected


async def test_math_verifier_refuses_an_unparsable_reference() -> None:
    rewards = reward_set({"name": "math", "kind": "math"})
    result = await rewards.score("\\boxed{1}", {"answer": ""})
    assert not result.ok and "does not parse" in str(result.reason)
    missing = await rewards.score("\\boxed{1}", {})
    assert not missing.ok and "no reference answer" in str(missing.reason)
