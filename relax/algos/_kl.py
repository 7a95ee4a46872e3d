"""KL estimators between the policy and a reference model, as a reward penalty or a loss term.

Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html. Tokens are
sampled from the policy ``q``; with ``log_r = log p_ref(x) - log q(x)``:

- ``k1 = -log_r``: unbiased for KL(q || p_ref), high variance, can be negative per token.
- ``k2 = log_r**2 / 2``: biased but low variance; as a loss on on-policy samples its expected
  gradient, ``E_q[-log_r * grad log q]``, is exactly the gradient of KL(q || p_ref).
- ``k3 = (exp(log_r) - 1) - log_r``: unbiased and low variance, and ``>= 0`` always since
  ``e^x >= 1 + x`` (used in GRPO's loss, Shao et al. 2024, arXiv:2402.03300).
"""

from __future__ import annotations

from typing import Literal

import torch

from relax.algos._masked import Aggregation, aggregate_loss

KLEstimator = Literal["k1", "k2", "k3"]


def kl_divergence(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, same shape as ``logprobs``.

    ``clamp`` bounds each token's estimate to ``[-clamp, clamp]``: k3 is exponential in the log
    ratio, and one token the reference finds wildly unlikely can otherwise dominate a batch.
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r**2
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r  # expm1 is exact near 0, where the two terms cancel
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def kl_reward_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """Token rewards with the KL penalty folded in: ``r_t - coef * KL_t`` on counted tokens.

    The classic RLHF shaping (Ouyang et al. 2022, "Training language models to follow
    instructions with human feedback", arXiv:2203.02155), feeding GAE or REINFORCE++. The penalty
    is a reward, so it is computed without gradient.
    """
    kl = kl_divergence(logprobs.detach(), ref_logprobs.detach(), estimator)
    return token_rewards - coef * kl * mask


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k3",
    agg: Aggregation = "token",
    clamp: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a loss term (GRPO style): aggregated per-token estimate.

    Multiply by the KL coefficient and add to the policy loss. Gradients flow into
    ``logprobs`` only. Metrics: ``kl`` (detached).
    """
    kl = kl_divergence(logprobs, ref_logprobs.detach(), estimator, clamp)
    kl = torch.where(mask > 0, kl, torch.zeros_like(kl))  # padding can hold -inf log-probs
    loss = aggregate_loss(kl, mask, agg)
    return loss, {"kl": loss.detach()}
