"""Advantage estimators and dynamic sampling: hand examples and identities."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algos import (
    discounted_returns,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    gae_advantages,
    group_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)


def test_grpo_hand_example() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3])  # ids need not be dense or sorted
    # group 7: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std 0.57735
    # -> +-0.5 / 0.57735 = +-0.866025; group 3 has zero variance -> 0
    adv = grpo_advantages(rewards, groups, eps=0.0)
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_grpo_zero_variance_and_singleton_groups_are_zero(eps: float) -> None:
    rewards = torch.tensor([0.3, 0.3, 0.3, 5.0])
    groups = torch.tensor([0, 0, 0, 1])  # group 1 has a single sample
    adv = grpo_advantages(rewards, groups, eps=eps)
    assert torch.equal(adv, torch.zeros(4))


def test_group_stats() -> None:
    mean, std, size = group_stats(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]))
    # group 0: mean 2, unbiased std sqrt(((-1)^2 + 1^2) / 1) = sqrt 2; group 1: singleton
    torch.testing.assert_close(mean, torch.tensor([2.0, 2.0, 10.0]))
    torch.testing.assert_close(std, torch.tensor([math.sqrt(2), math.sqrt(2), 0.0]))
    torch.testing.assert_close(size, torch.tensor([2.0, 2.0, 1.0]))


def test_dr_grpo_is_mean_centred_only() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 4.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0 mean 0.5; group 1 mean 3 -- no division by std
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    torch.testing.assert_close(dr_grpo_advantages(rewards, groups), expected)


def test_rloo_hand_example_and_baseline_identity() -> None:
    rewards = torch.tensor([1.0, 2.0, 6.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1])
    # baselines: (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> advantages -3, -1.5, 4.5;
    # the singleton group has no leave-one-out baseline -> 0
    adv = rloo_advantages(rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([-3.0, -1.5, 4.5, 0.0]))
    # identity: the leave-one-out baselines of a group sum to the group's reward sum
    baselines = rewards[:3] - adv[:3]
    assert baselines.sum().item() == pytest.approx(rewards[:3].sum().item())
    # identity: RLOO = n/(n-1) * (r - mean), so RLOO advantages sum to 0 in a group
    torch.testing.assert_close(adv[:3], 1.5 * dr_grpo_advantages(rewards[:3], groups[:3]))


def test_rloo_random_groups_sum_to_zero() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=gen)
    groups = torch.arange(6).repeat_interleave(4)
    adv = rloo_advantages(rewards, groups)
    torch.testing.assert_close(adv.view(6, 4).sum(-1), torch.zeros(6), atol=1e-6, rtol=0)


def test_sequence_to_token_rewards_places_reward_on_last_counted_token() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])  # right pad, left pad, empty
    out = sequence_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0] * 3]))


def test_discounted_returns_skip_masked_positions() -> None:
    rewards = torch.tensor([[1.0, 7.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    # t=2: 2; t=1 is skipped (its 7 is ignored, no discount); t=0: 1 + 0.5 * 2 = 2
    out = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[2.0, 0.0, 2.0]]))


def test_reinforce_pp_hand_example() -> None:
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # token returns (gamma 1): [[1, 1], [0, -]]; counted 1, 1, 0: mean 2/3,
    # deviations 1/3, 1/3, -2/3, unbiased var (6/9)/2 = 1/3, std 0.57735
    # -> (1/3)/0.57735 = 0.57735 and (-2/3)/0.57735 = -1.154701
    adv = reinforce_pp_advantages(rewards, mask)
    expected = torch.tensor([[0.57735, 0.57735], [-1.154701, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_reinforce_pp_baseline_subtracts_group_mean() -> None:
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 1)
    # baseline: [0.5, -0.5, 0, 0]; mean 0, unbiased var 0.5/3 = 1/6, std 0.408248
    # -> 0.5 / 0.408248 = 1.224745
    adv = reinforce_pp_advantages(rewards, mask, group_ids=groups)
    torch.testing.assert_close(
        adv, torch.tensor([[1.224745], [-1.224745], [0.0], [0.0]]), atol=1e-5, rtol=0
    )


def test_reinforce_pp_kl_penalty_enters_returns() -> None:
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.ones(2, 2)
    kl = torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    # token rewards [[-0.5, 1], [0, 0]] -> returns [[0.5, 1], [0, 0]]; whitened afterwards
    with_kl = reinforce_pp_advantages(rewards, mask, kl_penalty=kl)
    returns = torch.tensor([[0.5, 1.0], [0.0, 0.0]])
    mean, std = returns.mean(), returns.std()
    torch.testing.assert_close(with_kl, (returns - mean) / std, atol=1e-5, rtol=0)


def test_gae_hand_example() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72); V after the last token is 0
    # t=2: delta = 1 - 0.7 = 0.3                        A2 = 0.3
    # t=1: delta = 0.9*0.7 - 0.6 = 0.03                 A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04                 A0 = 0.04 + 0.72*0.246 = 0.21712
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_gae_lambda_one_gamma_one_is_returns_minus_values() -> None:
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 6, generator=gen)
    values = torch.randn(4, 6, generator=gen)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0  # right padding
    mask[2, :2] = 0  # left padding
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    expected = (discounted_returns(rewards, mask, gamma=1.0) - values) * mask
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, discounted_returns(rewards, mask), atol=1e-5, rtol=0)


def test_gae_skips_masked_positions() -> None:
    # a masked token in the middle (e.g. tool output) must not change the recursion
    rewards = torch.tensor([[0.0, 99.0, 1.0]])
    values = torch.tensor([[0.5, 99.0, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    ref, _ = gae_advantages(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.7]]), torch.ones(1, 2), 0.9, 0.8
    )
    torch.testing.assert_close(adv[:, [0, 2]], ref)
    assert adv[0, 1].item() == 0.0


def test_dynamic_sampling_drops_exactly_zero_variance_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 4])
    # group 0 all 1, group 2 all 0.5, group 3 singleton -> dropped; groups 1 and 4 kept
    keep = dynamic_sampling_mask(rewards, groups)
    expected = torch.tensor([False, False, True, True, False, False, False, True, True, True])
    assert torch.equal(keep, expected)
    # agreement with GRPO: kept groups are exactly those with non-zero std
    _, std, _ = group_stats(rewards, groups)
    assert torch.equal(keep, std > 0)
    # tolerance: a spread of 0.1 counts as zero variance under atol=0.2
    near = dynamic_sampling_mask(
        torch.tensor([1.0, 1.1, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), 0.2
    )
    assert near.tolist() == [False, False, True, True]
