"""Each verifier kind on hand-made cases, built from config the way the reward role builds them."""

from __future__ import annotations

from typing import Any

import pytest

from relax.config import RewardConfig
from relax.errors import ConfigError
from relax.rewards import RewardSet

pytestmark = pytest.mark.anyio


def one(kind: str, *, answer_key: str = "answer", max_tokens: int | None = None, **fields: Any):
    """A RewardSet of a single function named "f"."""
    config = RewardConfig(functions=[{"name": "f", "kind": kind, **fields}])
    return RewardSet.from_config(config, answer_key=answer_key, max_response_tokens=max_tokens)


async def reward(rewards: RewardSet, text: str, sample: dict[str, Any] | None = None, **kw: Any):
    result = await rewards.score(text, sample or {}, **kw)
    assert result.ok, result.reason
    return result.reward


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("Paris", "Paris", 1.0),
        ("  paris. ", "Paris", 1.0),
        ("I think the answer is Paris.", "Paris", 1.0),
        ("\\boxed{Paris}", "paris", 1.0),
        ("London", "Paris", 0.0),
        ("#### 42", 42, 1.0),  # a non-string reference is compared as its str()
        ("42.0", 42, 0.0),  # exact means exact: use numeric for that
    ],
)
async def test_exact_match(text: str, answer: Any, expected: float) -> None:
    assert await reward(one("exact_match"), text, {"answer": answer}) == expected


async def test_exact_match_options() -> None:
    strict = one("exact_match", options={"case_sensitive": True, "extract": "none"})
    assert await reward(strict, "Paris", {"answer": "Paris"}) == 1.0
    assert await reward(strict, "paris", {"answer": "Paris"}) == 0.0
    assert await reward(strict, "answer is Paris", {"answer": "Paris"}) == 0.0
    keyed = one("exact_match", answer_key="solution")
    assert await reward(keyed, "7", {"solution": "7"}) == 1.0


async def test_exact_match_without_reference_fails_the_sample() -> None:
    result = await one("exact_match").score("Paris", {"question": "capital?"})
    assert not result.ok and result.reward is None
    assert "no reference answer 'answer'" in (result.reason or "")


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("so it is 1,234", "1234", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("3/4", 0.75, 1.0),
        ("-5", -5, 1.0),
        ("10-5", -5, 0.0),
        ("42.0000001", 42, 1.0),  # within the default abs_tol 1e-6
        ("42.01", 42, 0.0),
        ("#### 18\n", "Janet makes $18 a day. #### 18", 1.0),  # last number of the reference
        ("no digits at all", 3, 0.0),  # the policy's fault: a zero reward, not a failure
    ],
)
async def test_numeric(text: str, answer: Any, expected: float) -> None:
    assert await reward(one("numeric"), text, {"answer": answer}) == expected


async def test_numeric_tolerance_options() -> None:
    loose = one("numeric", options={"abs_tol": 0.1})
    assert await reward(loose, "42.05", {"answer": 42}) == 1.0
    relative = one("numeric", options={"abs_tol": 0, "rel_tol": 0.01})
    assert await reward(relative, "1005", {"answer": 1000}) == 1.0
    assert await reward(relative, "1011", {"answer": 1000}) == 0.0


async def test_numeric_reference_not_a_number_fails() -> None:
    result = await one("numeric").score("5", {"answer": "five"})
    assert not result.ok and "is not a number" in (result.reason or "")


async def test_regex_modes() -> None:
    fmt = "<think>.*</think>\\s*<answer>.*</answer>"
    search = one("regex", pattern="<answer>")
    assert await reward(search, "bla <answer>1</answer>") == 1.0
    assert await reward(search, "bla") == 0.0
    full = one("regex", pattern=fmt, options={"mode": "fullmatch", "flags": ["DOTALL"]})
    assert await reward(full, "<think>a\nb</think>\n<answer>1</answer>\n") == 1.0
    assert await reward(full, "<think>a</think><answer>1</answer> extra") == 0.0
    no_dotall = one("regex", pattern=fmt, options={"mode": "fullmatch"})
    assert await reward(no_dotall, "<think>a\nb</think><answer>1</answer>") == 0.0
    match = one("regex", pattern="yes", options={"mode": "match", "flags": ["IGNORECASE"]})
    assert await reward(match, "YES indeed") == 1.0
    assert await reward(match, "oh yes") == 0.0


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(0, 0.0), (80, 0.0), (90, -0.5), (100, -1.0), (101, -1.0), (5000, -1.0)],
)
async def test_length_penalty_dapo(tokens: int, expected: float) -> None:
    rewards = one("length_penalty", options={"max_len": 100, "cache": 20})
    assert await reward(rewards, "x", response_tokens=tokens) == pytest.approx(expected)


async def test_length_penalty_defaults_and_zero_cache() -> None:
    # max_len from the rollout's max_new_tokens, cache = max_len // 5 = 40.
    rewards = one("length_penalty", max_tokens=200)
    assert await reward(rewards, "x", response_tokens=160) == 0.0
    assert await reward(rewards, "x", response_tokens=180) == pytest.approx(-0.5)
    hard = one("length_penalty", options={"max_len": 10, "cache": 0})
    assert await reward(hard, "x", response_tokens=10) == 0.0
    assert await reward(hard, "x", response_tokens=11) == -1.0


async def test_length_penalty_without_token_count_fails() -> None:
    result = await one("length_penalty", options={"max_len": 10}).score("x", {})
    assert not result.ok and "needs response_tokens" in (result.reason or "")


async def test_python_by_import_path() -> None:
    path = "tests.rewards.fixture_fns:"
    keyword = one("python", target=path + "contains_keyword", options={"keyword": "ok"})
    assert await reward(keyword, "it is ok") == 1.0
    assert await reward(keyword, "it is fine") == 0.0
    async_fn = one("python", target=path + "async_length")
    assert await reward(async_fn, "abcd", {"scale": 2}) == 2.0
    assert await reward(one("python", target=path + "returns_bool"), "ok") == 1.0
    assert await reward(one("python", target=path + "scorer"), "x") == 0.25  # async __call__


async def test_python_gets_a_copy_of_the_sample() -> None:
    rewards = one("python", target="tests.rewards.fixture_fns:mutates_sample")
    sample = {"answer": "7"}
    assert await reward(rewards, "x", sample) == 0.5
    assert sample == {"answer": "7"}


@pytest.mark.parametrize(
    ("fields", "path", "message"),
    [
        (
            {"kind": "python", "target": "tests.rewards.no_such_module:f"},
            "reward.functions[0].target",
            "cannot import",
        ),
        (
            {"kind": "python", "target": "tests.rewards.fixture_fns:missing"},
            "reward.functions[0].target",
            "no attribute",
        ),
        (
            {"kind": "python", "target": "tests.rewards.fixture_fns:not_callable"},
            "reward.functions[0].target",
            "not callable",
        ),
        ({"kind": "numeric", "options": {"tol": 1}}, "reward.functions[0].options.tol", "unknown"),
        (
            {"kind": "regex", "pattern": "a", "options": {"mode": "anchored"}},
            "reward.functions[0].options.mode",
            "fullmatch",
        ),
        (
            {"kind": "regex", "pattern": "a", "options": {"flags": ["NOPE"]}},
            "reward.functions[0].options.flags",
            "unknown flag",
        ),
        ({"kind": "length_penalty"}, "reward.functions[0].options.max_len", "positive max_len"),
        (
            {"kind": "length_penalty", "options": {"max_len": 10, "cache": 11}},
            "reward.functions[0].options.cache",
            "between 0 and max_len",
        ),
        (
            {"kind": "exact_match", "options": {"case_sensitive": "yes"}},
            "reward.functions[0].options.case_sensitive",
            "must be bool",
        ),
        (
            {"kind": "numeric", "options": {"abs_tol": True}},
            "reward.functions[0].options.abs_tol",
            "must be int or float",
        ),
    ],
)
def test_bad_functions_fail_at_build_time(fields: dict[str, Any], path: str, message: str) -> None:
    config = RewardConfig(functions=[{"name": "f", **fields}])
    with pytest.raises(ConfigError) as caught:
        RewardSet.from_config(config)
    [issue] = caught.value.issues
    assert issue.path == path
    assert message in issue.message


def test_every_bad_function_is_listed() -> None:
    config = RewardConfig(
        functions=[
            {"name": "a", "kind": "numeric", "options": {"bad": 1}},
            {"name": "b", "kind": "exact_match"},
            {"name": "c", "kind": "length_penalty"},
        ]
    )
    with pytest.raises(ConfigError) as caught:
        RewardSet.from_config(config)
    assert [i.path for i in caught.value.issues] == [
        "reward.functions[0].options.bad",
        "reward.functions[2].options.max_len",
    ]


async def test_default_config_is_one_exact_match() -> None:
    rewards = RewardSet.from_config(RewardConfig())
    result = await rewards.score("#### 4", {"answer": "4"})
    assert result.ok and result.reward == 1.0 and result.components == {"correct": 1.0}
