"""The model-backed reward kinds: ``reward_model`` scores are the model's own (an independent
forward pass gives the same numbers, batched or one by one), and a ``judge``'s reply is parsed
to a score in [0, 1] or fails its sample with the reply as the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config import parse_config
from relax.errors import ConfigError
from relax.rewards import RewardSet, Sample
from tests.rewards.model_builders import bigram_judge, independent_scores, random_reward_model

pytestmark = pytest.mark.anyio

PROMPTS = ["3+4=", "1+1=", "", "9+0=", "what is 2+2? ", "7+7="]
RESPONSES = ["7", "two", "only a response", "9 because", "4", "14 is the answer, surely"]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_reward_model(tmp_path_factory.mktemp("rm") / "rm")


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bigram_judge(tmp_path_factory.mktemp("judge") / "judge")


def samples() -> list[Sample]:
    return [
        Sample(prompt=p, response=r, uid=f"s{i}")
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
    ]


def texts() -> list[str]:
    """What the reward model reads of each of ``samples()``: prompt + response."""
    return [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]


def rm_set(folder: Path, **model: object) -> RewardSet:
    keys = "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in model.items())
    text = f"""
[model.init]
[[reward.functions]]
name = "rm"
kind = "reward_model"
[reward.functions.model]
path = "{folder}"
device = "cpu"
{keys}"""
    return RewardSet.from_config(parse_config(text).reward)


def judge_set(folder: Path, pattern: str = r"^(\d)") -> RewardSet:
    text = f"""
[model.init]
[[reward.functions]]
name = "judge"
kind = "judge"
[reward.functions.model]
path = "{folder}"
device = "cpu"
batch_size = 3
[reward.functions.judge]
template = "Q: {{prompt}}\\nA: {{response}}"
score_pattern = '{pattern}'
score_range = [0, 9]
max_new_tokens = 3
"""
    return RewardSet.from_config(parse_config(text).reward)


async def test_reward_model_scores_are_the_models_own(reward_model: Path) -> None:
    rewards = rm_set(reward_model, batch_size=4)
    rewards.load()
    results = await rewards.score_batch(samples())
    assert all(r.ok for r in results), [r.reason for r in results]
    expected = independent_scores(reward_model, texts())
    got = [r.reward for r in results]
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(got)) == len(got)  # the texts really were told apart
    assert [r.components["rm"] for r in results] == got


async def test_batching_gives_the_scores_of_one_by_one(reward_model: Path) -> None:
    whole = await rm_set(reward_model, batch_size=64).score_batch(samples())
    single = rm_set(reward_model, batch_size=1)
    alone = [(await single.score_batch([s]))[0] for s in samples()]
    assert [r.reward for r in whole] == pytest.approx([r.reward for r in alone], abs=1e-5)


async def test_a_long_text_keeps_its_last_max_length_tokens(reward_model: Path) -> None:
    results = await rm_set(reward_model, max_length=5).score_batch(samples())
    expected = independent_scores(reward_model, texts(), max_length=5)
    assert [r.reward for r in results] == pytest.approx(expected, abs=1e-5)


async def test_an_empty_text_fails_only_its_sample(reward_model: Path) -> None:
    empty, full = await rm_set(reward_model).score_batch(
        [Sample(prompt="", response=""), Sample(prompt="1+1=", response="2")]
    )
    assert not empty.ok and "prompt + response is empty" in str(empty.reason)
    assert full.ok and full.reward == pytest.approx(independent_scores(reward_model, ["1+1=2"])[0])


def test_a_missing_folder_is_a_config_error_at_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        rm_set(tmp_path / "nowhere")
    [issue] = info.value.issues
    assert issue.path == "reward.functions[0].model.path"
    assert "does not exist" in issue.message


def test_a_classifier_with_two_labels_is_refused_when_loaded(tmp_path: Path) -> None:
    rewards = rm_set(random_reward_model(tmp_path / "two", num_labels=2))
    with pytest.raises(ConfigError) as info:
        rewards.load()
    [issue] = info.value.issues
    assert issue.path == "reward.functions[0].model.path"
    assert "num_labels = 1" in issue.message


async def test_the_judge_reads_a_score_from_its_reply(judge_model: Path) -> None:
    rewards = judge_set(judge_model)
    batch = [
        Sample(prompt="3+4=", response="7", uid="a"),
        Sample(prompt="1+1=", response="the answer is 2", uid="b"),
        Sample(prompt="2+7=", response="it is 9", uid="c"),
        Sample(prompt="0+0=", response="0", uid="d"),
    ]
    results = await rewards.score_batch(batch)
    # The bigram judge repeats the response's last digit: "777" -> 7 on [0, 9].
    assert [r.reward for r in results] == pytest.approx([7 / 9, 2 / 9, 1.0, 0.0])
    alone = [(await rewards.score_batch([s]))[0].reward for s in batch]
    assert alone == [r.reward for r in results]


async def test_a_reply_without_a_score_fails_only_its_sample(judge_model: Path) -> None:
    rewards = judge_set(judge_model)
    batch = [
        Sample(prompt="3+4=", response="seven", uid="a"),
        Sample(prompt="3+4=", response="7", uid="b"),
    ]
    bad, good = await rewards.score_batch(batch)
    assert good.ok and good.reward == pytest.approx(7 / 9)
    assert not bad.ok and bad.reward is None
    assert bad.failures == {"judge": "invalid"}
    assert bad.reason == "judge 'judge': judge reply has no score matching '^(\\\\d)': 'xxx'"
    assert rewards.statistics()["functions"]["judge"]["failures"] == {"invalid": 1}


async def test_a_score_outside_the_range_fails_its_sample(judge_model: Path) -> None:
    # "(\d\d)" reads "77" from "777": above score_range = [0, 9].
    [result] = await judge_set(judge_model, r"(\d\d)").score_batch(
        [Sample(prompt="", response="7")]
    )
    assert not result.ok
    assert "judge score 77 is outside score_range [0, 9]" in str(result.reason)
