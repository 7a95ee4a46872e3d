"""Off-policy corrections for asynchronous training.

In async RL the tokens were sampled by a behaviour policy that differs from the policy being
trained: the rollout engine (vLLM, other kernels, other precision) and, with ``staleness > 0``,
an older version. These functions turn the log-prob gap into per-token importance weights
``[batch, seq]`` (constants, no gradient; 0 where ``mask`` is 0) that plug into
``ppo_loss(..., is_weights=...)``, plus AReaL's decoupled PPO objective. The configurable
suite (sequence-level weights, rejection sampling, batch normalisation) is in
``relax.algos._correction``; ``tis_weights`` and ``masked_is_weights`` are two of its cases.
"""

from __future__ import annotations

import torch

from relax.algos._losses import Metrics, ppo_loss
from relax.algos._masked import Aggregation, masked_mean


def _ratio(
    target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``exp(target - behaviour)`` on counted tokens, 1 on padding, without gradient."""
    log_ratio = (target_logprobs - behavior_logprobs).detach()
    return torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio)).exp()


def tis_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """Truncated importance sampling weights ``min(pi_old / pi_rollout, cap)``.

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (fengyao.notion.site/off-policy-rl); truncation as in Espeholt et al. 2018, IMPALA/V-trace,
    arXiv:1802.01561. ``old_logprobs`` are the trainer's recomputed log-probs of the sampled
    tokens, ``rollout_logprobs`` the engine's; the cap bounds the variance that the few tokens
    the engine under-sampled would add.
    """
    return _ratio(old_logprobs, rollout_logprobs, mask).clamp(max=cap) * mask


def masked_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """Masked importance sampling (IcePop): the ratio inside ``[low, high]``, 0 outside.

    Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model" (Ring-1T), arXiv:2510.18855, §IcePop. Rather than truncating, tokens where
    trainer and engine disagree too much are dropped from the gradient entirely, since their
    mismatch (not their reward) would drive the update.
    """
    ratio = _ratio(old_logprobs, rollout_logprobs, mask)
    keep = (ratio >= low) & (ratio <= high)
    return torch.where(keep, ratio, torch.zeros_like(ratio)) * mask


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    behavior_weight_cap: float | None = None,
    agg: Aggregation = "token-mean",
    norm_length: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """AReaL's decoupled PPO objective for stale, off-policy samples.

    Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
    Reasoning", arXiv:2505.24298, §5 (after Hilton et al. 2022, arXiv:2110.00641):
    ``L = -(pi_prox / pi_behav) * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`` with
    ``r = pi / pi_prox``. The trust region is anchored at the *proximal* policy (the trainer's
    weights just before this update, log-probs recomputed by the trainer), not at the stale
    behaviour policy that sampled the tokens; the behaviour gap is corrected by the constant
    importance weight ``pi_prox / pi_behav``, optionally capped at ``behavior_weight_cap``
    (tokens above the cap are dropped, as in AReaL).

    Metrics: those of ``ppo_loss`` plus ``behavior_weight_mean`` and ``behavior_capped_frac``.
    """
    weights = _ratio(proximal_logprobs, behavior_logprobs, mask)
    capped = torch.zeros_like(weights, dtype=torch.bool)
    if behavior_weight_cap is not None:
        capped = weights > behavior_weight_cap
        weights = torch.where(capped, torch.zeros_like(weights), weights)
    loss, metrics = ppo_loss(
        logprobs,
        proximal_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        agg=agg,
        is_weights=weights * mask,
        norm_length=norm_length,
    )
    metrics["behavior_weight_mean"] = masked_mean(weights, mask)
    metrics["behavior_capped_frac"] = masked_mean(capped.float(), mask)
    return loss, metrics
