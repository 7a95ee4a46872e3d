"""[algorithm]: loss aggregation, KL estimators and clamp, [algorithm.rollout_correction], and
the former names (aggregation, off_policy, tis_cap) keeping their meaning."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config import AlgorithmConfig, RolloutCorrectionConfig, load_config, parse_config
from relax.errors import ConfigError

GOOD = Path(__file__).parent / "good" / "off_policy_corrections.toml"


def _issues(text: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config("[model.init]\n" + text, source="test.toml")
    return [(issue.path, issue.message) for issue in info.value.issues]


def test_every_new_key_parses_into_its_value() -> None:
    algo = load_config(GOOD).algorithm
    assert algo.loss_aggregation == "seq-mean-token-sum-norm"
    assert algo.loss_norm_length == 1024.0
    assert (algo.kl.estimator, algo.kl.clamp) == ("low_var_kl", 5.0)
    assert algo.rollout_correction == RolloutCorrectionConfig(
        is_level="geometric",
        is_mode="mask",
        is_low=0.99,
        is_high=1.01,
        is_batch_normalize=True,
        reject_token_low=0.1,
        reject_token_high=10.0,
        reject_seq_k1=0.05,
        reject_seq_k3=0.05,
        reject_geo_low=0.98,
        reject_geo_high=1.02,
        on_reject="drop",
    )


def test_defaults_change_nothing() -> None:
    algo = AlgorithmConfig()
    assert algo.loss_aggregation == "token-mean" and algo.aggregation is None
    assert algo.loss_norm_length is None and algo.dual_clip is None
    assert algo.kl.clamp is None  # no estimator is clamped unless asked
    assert algo.rollout_correction == RolloutCorrectionConfig()
    assert algo.rollout_correction.is_level == "none"


@pytest.mark.parametrize(
    ("former", "meant"), [("token", "token-mean"), ("sequence", "seq-mean-token-mean")]
)
def test_former_aggregation_keeps_its_meaning(former: str, meant: str) -> None:
    config = parse_config(f'[model.init]\n[algorithm]\naggregation = "{former}"\n', source="t")
    assert config.algorithm.loss_aggregation == meant
    # said twice the same way is fine; two meanings are an error naming the key
    same = f'[algorithm]\naggregation = "{former}"\nloss_aggregation = "{meant}"\n'
    assert parse_config("[model.init]\n" + same, source="t").algorithm.loss_aggregation == meant
    other = "seq-mean-token-sum"
    [(path, message)] = _issues(
        f'[algorithm]\naggregation = "{former}"\nloss_aggregation = "{other}"\n'
    )
    assert path == "algorithm.aggregation" and meant in message and other in message


def test_overrides_reach_the_new_keys() -> None:
    config = parse_config(
        "[model.init]\n",
        source="t",
        overrides=[
            'algorithm.rollout_correction.is_level="sequence"',
            "algorithm.rollout_correction.reject_seq_k3=0.2",
            'algorithm.kl.estimator="mse"',
            'algorithm.loss_aggregation="seq-mean-token-sum"',
        ],
    )
    rc = config.algorithm.rollout_correction
    assert (rc.is_level, rc.reject_seq_k3) == ("sequence", 0.2)
    assert config.algorithm.kl.estimator == "mse"
    assert config.algorithm.loss_aggregation == "seq-mean-token-sum"


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('[algorithm]\nloss_aggregation = "seq-mean"\n', "algorithm.loss_aggregation"),
        ("[algorithm]\nloss_norm_length = 0\n", "algorithm.loss_norm_length"),
        ('[algorithm]\naggregation = "token-mean"\n', "algorithm.aggregation"),
        ('[algorithm.kl]\nestimator = "k4"\n', "algorithm.kl.estimator"),
        ("[algorithm.kl]\nclamp = 0\n", "algorithm.kl.clamp"),
        (
            '[algorithm.rollout_correction]\nis_mode = "clip"\n',
            "algorithm.rollout_correction.is_mode",
        ),
        (
            "[algorithm.rollout_correction]\nis_high = -1.0\n",
            "algorithm.rollout_correction.is_high",
        ),
        (
            '[algorithm.rollout_correction]\nis_mode = "mask"\nis_high = 0.5\n',
            "algorithm.rollout_correction.is_high",
        ),
        (
            '[algorithm.rollout_correction]\nis_mode = "mask"\nis_low = 2.0\nis_high = 1.5\n',
            "algorithm.rollout_correction.is_low",
        ),
        (
            "[algorithm.rollout_correction]\nreject_geo_low = 1.1\nreject_geo_high = 1.1\n",
            "algorithm.rollout_correction.reject_geo_low",
        ),
        (
            "[algorithm.rollout_correction]\nreject_seq_k1 = 0\n",
            "algorithm.rollout_correction.reject_seq_k1",
        ),
        (
            '[algorithm.rollout_correction]\non_reject = "keep"\n',
            "algorithm.rollout_correction.on_reject",
        ),
        (
            '[algorithm]\noff_policy = "icepop"\n[algorithm.rollout_correction]\nreject_seq_k3 = 1.0\n',
            "algorithm.rollout_correction.reject_seq_k3",
        ),
        (
            '[algorithm]\noff_policy = "decoupled"\n[algorithm.rollout_correction]\nis_level = "token"\n',
            "algorithm.rollout_correction.is_level",
        ),
    ],
)
def test_bad_values_name_their_key(text: str, path: str) -> None:
    assert [p for p, _ in _issues(text)] == [path]


def test_consistent_former_and_new_keys_are_accepted() -> None:
    # tis_cap at its default, or equal to is_high, says nothing different
    for tis_cap in ("", "tis_cap = 3.0\n"):
        text = f'[algorithm]\n{tis_cap}[algorithm.rollout_correction]\nis_level = "token"\nis_high = 3.0\n'
        parse_config("[model.init]\n" + text, source="t")
    # rejection works beside AReaL's decoupled loss (it only removes tokens)
    text = '[algorithm]\noff_policy = "decoupled"\n[algorithm.rollout_correction]\nreject_seq_k3 = 1.0\n'
    parse_config("[model.init]\n" + text, source="t")
    # a quickstart copy that lists the table at its defaults may still use off_policy
    text = '[algorithm]\noff_policy = "tis"\n[algorithm.rollout_correction]\nis_level = "none"\n'
    parse_config("[model.init]\n" + text, source="t")


def test_the_norm_length_defaults_to_the_generation_budget() -> None:
    """Dr. GRPO's constant (and veRL's default) is the generation budget: unless set, the
    cluster takes rollout.max_new_tokens; an explicit value wins."""
    norm = '[algorithm]\nloss_aggregation = "seq-mean-token-sum-norm"\n'
    cfg = parse_config("[model.init]\n" + norm, source="t")
    assert cfg.algorithm.loss_norm_length == cfg.rollout.max_new_tokens == 64
    cfg = parse_config("[model.init]\n[rollout]\nmax_new_tokens = 12\n" + norm, source="t")
    assert cfg.algorithm.loss_norm_length == 12
    cfg = parse_config("[model.init]\n" + norm + "loss_norm_length = 100\n", source="t")
    assert cfg.algorithm.loss_norm_length == 100
    # Other modes leave it unset; AlgorithmConfig alone (no [rollout] to read) still asks.
    assert parse_config("[model.init]\n", source="t").algorithm.loss_norm_length is None
    with pytest.raises(ValueError, match="loss_norm_length"):
        AlgorithmConfig(loss_aggregation="seq-mean-token-sum-norm")
