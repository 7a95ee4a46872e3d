"""Advantage estimators and DAPO dynamic sampling.

Group estimators (GRPO, Dr. GRPO, RLOO) take one scalar reward per sample ``[batch]`` and the
``group_ids`` ``[batch]`` naming each sample's prompt group; they return one advantage per
sample ``[batch]``, which the losses broadcast over that sample's response tokens. Token
estimators (REINFORCE++, GAE) return ``[batch, seq]`` advantages, zero where ``mask`` is 0.
"""

from __future__ import annotations

import torch

from relax.algos._masked import masked_whiten


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to dense indices 0..G-1 (groups need not be contiguous)."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def _group_reduce(values: torch.Tensor, index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-group sums of ``values``, gathered back to each sample: ``[batch]``."""
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    return sums.index_add(0, index, values)[index]


def _constant_groups(r: torch.Tensor, index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``[batch]`` bool: the sample's group has all rewards *exactly* equal (max == min).

    Sums round: the float32 mean of eight 0.1s is off by ~7e-9, so ``r - mean`` and the std are
    tiny but non-zero, and dividing by ``std + eps`` blows that noise up to a real-looking
    advantage (-0.0074 per sample). Exact equality of the inputs is what "no signal" means,
    so those groups are zeroed outright instead of trusting the arithmetic.
    """
    gmax = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device)
    gmin = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device)
    gmax = gmax.scatter_reduce(0, index, r, reduce="amax")
    gmin = gmin.scatter_reduce(0, index, r, reduce="amin")
    return (gmax == gmin)[index]


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    """Advantages come out at least float32 (bfloat16 rewards are promoted)."""
    return torch.promote_types(rewards.dtype, torch.float32)


def group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's group ``(mean, unbiased std, size)``, all ``[batch]``.

    A group of one has std 0 (not NaN). Sums are taken in float64 (and returned in the
    rewards' float dtype, at least float32), and a group whose rewards are all exactly equal
    gets that very value as its mean and std exactly 0, whatever the rounding would say.
    """
    out = _out_dtype(rewards)
    r = rewards.to(torch.float64)
    index, n_groups = _group_index(group_ids)
    size = _group_reduce(torch.ones_like(r), index, n_groups)
    mean = _group_reduce(r, index, n_groups) / size
    sq_dev = _group_reduce((r - mean) ** 2, index, n_groups)
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    constant = _constant_groups(r, index, n_groups)
    mean = torch.where(constant, r, mean)
    std = torch.where(constant, torch.zeros_like(std), std)
    return mean.to(out), std.to(out), size.to(out)


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantage: ``(r - mean_group) / (std_group + eps)``, per sample ``[batch]``.

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, §4.1.2. The std is the unbiased sample
    std (as in TRL and verl). A group whose rewards are all equal (or a group of one) gets
    advantage exactly 0, never NaN and never rounding noise, for any reward value and dtype.

    Singleton groups: Relax's convention is advantage 0 (one sample has nothing to be compared
    with, so it carries no signal). veRL's differs: for a group of one it takes mean 0 and
    std 1, so the advantage is the raw score. The same holds for ``dr_grpo_advantages`` and
    ``rloo_advantages`` (0 for a group of one).
    """
    out = _out_dtype(rewards)
    r = rewards.to(torch.float64)
    mean, std, _ = group_stats(r, group_ids)
    # Zero-spread groups are set to 0 explicitly so that eps=0 cannot give 0/0 = NaN.
    adv = torch.where(std > 0, (r - mean) / (std + eps), torch.zeros_like(mean))
    return adv.to(out)


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantage: ``r - mean_group``, no std division, per sample ``[batch]``.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783. Dividing by the std up-weights too-easy and too-hard prompts; the paper's
    other fix (no length normalisation) lives in the loss: use
    ``agg="seq-mean-token-sum-norm"`` (the paper's constant ``MAX_TOKENS`` divisor).
    A group whose rewards are all equal gets exactly 0.
    """
    r = rewards.to(torch.float64)
    mean, _, _ = group_stats(r, group_ids)  # exactly r on a constant group
    return (r - mean).to(_out_dtype(rewards))


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO advantage: ``r_i - mean_{j != i} r_j`` within the group, per sample ``[batch]``.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
    from Human Feedback in LLMs", arXiv:2402.14740. The leave-one-out baseline is unbiased
    because it does not depend on the sample's own reward. A group of one has no other sample to
    compare with and gets advantage 0; so does a group whose rewards are all equal (exactly).
    """
    r = rewards.to(torch.float64)
    index, n_groups = _group_index(group_ids)
    size = _group_reduce(torch.ones_like(r), index, n_groups)
    total = _group_reduce(r, index, n_groups)
    baseline = (total - r) / (size - 1).clamp(min=1)
    no_signal = (size <= 1) | _constant_groups(r, index, n_groups)
    adv = torch.where(no_signal, torch.zeros_like(r), r - baseline)
    return adv.to(_out_dtype(rewards))


def sequence_to_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's scalar reward on its last counted token: ``[batch]`` → ``[batch, seq]``.

    Outcome rewards arrive per sequence; token estimators (GAE, REINFORCE++) need them as a
    sparse per-token signal at the end of the response. Rows with an empty mask get nothing.
    """
    seq = mask.shape[-1]
    positions = torch.arange(seq, device=mask.device).expand_as(mask)
    # Index of the last position where mask is 1 (0 for an empty row, zeroed below).
    last = torch.where(mask > 0, positions, torch.zeros_like(positions)).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    out.scatter_(-1, last.unsqueeze(-1), rewards.unsqueeze(-1))
    return out * mask


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over counted tokens, ``[batch, seq]``.

    Positions where ``mask`` is 0 are skipped (they neither add reward nor discount), so prompt
    padding or interleaved tool-output tokens do not break the chain.
    """
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        m = mask[:, t].to(token_rewards.dtype)
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running
    return returns * mask


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    kl_penalty: torch.Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ advantage, per token ``[batch, seq]``, whitened over the whole batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    arXiv:2501.03262. The sequence reward sits on the last response token, the (already
    coefficient-scaled) per-token ``kl_penalty`` is subtracted at every token, returns-to-go are
    taken, and the result is normalised by the *global* batch mean/std instead of a per-prompt
    std. With ``group_ids`` this is the "REINFORCE++-baseline" variant: each reward first has its
    group mean subtracted, which removes the prompt's difficulty before global normalisation.
    """
    rewards = rewards.to(_out_dtype(rewards))
    if group_ids is not None:
        rewards = dr_grpo_advantages(rewards, group_ids)
    token_rewards = sequence_to_token_rewards(rewards, mask)
    if kl_penalty is not None:
        token_rewards = token_rewards - kl_penalty * mask
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps=eps)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation for PPO with a critic; returns ``(advantages, returns)``.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", arXiv:1506.02438:
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    with ``V`` after the last response token taken as 0 (the episode ends there). Positions where
    ``mask`` is 0 are skipped: the recursion jumps over them to the next counted token. Both
    outputs are ``[batch, seq]`` and 0 where ``mask`` is 0; ``returns = advantages + values`` is
    the critic's regression target. Whitening the advantages is left to the caller
    (``masked_whiten``).
    """
    dtype = torch.promote_types(values.dtype, torch.float32)
    token_rewards, values, m_all = token_rewards.to(dtype), values.to(dtype), mask.to(dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        m = m_all[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # On a skipped position carry the state from the next counted token unchanged.
        last_gae = m * gae + (1 - m) * last_gae
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = last_gae
    advantages = advantages * m_all
    returns = (advantages + values) * m_all
    return advantages, returns


def dynamic_sampling_mask(
    rewards: torch.Tensor, group_ids: torch.Tensor, atol: float = 0.0
) -> torch.Tensor:
    """DAPO dynamic sampling: a ``[batch]`` bool mask keeping samples whose group has reward spread.

    Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476, §3.2. A group whose rewards are all equal (all right or all wrong) has zero
    group-relative advantage and contributes no gradient, so it is dropped and the batch
    refilled. A group is kept when ``max - min > atol``.
    """
    index, n_groups = _group_index(group_ids)
    r = rewards.to(_out_dtype(rewards))
    gmax = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device)
    gmin = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device)
    gmax = gmax.scatter_reduce(0, index, r, reduce="amax")
    gmin = gmin.scatter_reduce(0, index, r, reduce="amin")
    return (gmax - gmin)[index] > atol
