"""KL estimators between the policy and a reference model, as a reward penalty or a loss term.

Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html. Tokens are
sampled from the policy ``q``; with ``log_r = log p_ref(x) - log q(x)``:

- ``k1 = -log_r``: unbiased for KL(q || p_ref), high variance, can be negative per token.
- ``k2 = log_r**2 / 2``: biased but low variance; as a loss on on-policy samples its expected
  gradient, ``E_q[-log_r * grad log q]``, is exactly the gradient of KL(q || p_ref).
- ``k3 = (exp(log_r) - 1) - log_r``: unbiased and low variance, and ``>= 0`` always since
  ``e^x >= 1 + x`` (used in GRPO's loss, Shao et al. 2024, arXiv:2402.03300).

veRL's names (``kl_loss_type`` / ``kl_penalty``) are accepted too: ``"mse"`` is k2, ``"abs"``
is ``|log_r|`` and ``"low_var_kl"`` is k3 clamped to ``[-10, 10]``.
"""

from __future__ import annotations

from typing import Literal

import torch

from relax.algos._masked import Aggregation, aggregate_loss

KLEstimator = Literal["k1", "k2", "k3", "abs", "mse", "low_var_kl"]

LOW_VAR_KL_BOUND = 10.0
"""veRL's ``low_var_kl`` clamps each token's k3 to ``[-10, 10]``."""
_LOG_RATIO_BOUND = 20.0
"""``low_var_kl`` also clamps the log ratio to ``[-20, 20]`` before ``exp``, as veRL does: the
value is the same (k3 of a log ratio beyond ±12 is above 10 either way), but ``exp`` cannot
overflow, so the clamped token's zero gradient cannot turn into ``0 * inf = NaN``."""


def kl_divergence(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, same shape as ``logprobs``.

    ``log_r = ref_logprobs - logprobs``; ``k1 = -log_r``, ``abs = |log_r|``,
    ``k2 = mse = log_r**2 / 2``, ``k3 = expm1(log_r) - log_r`` and
    ``low_var_kl = clamp(k3(clamp(log_r, -20, 20)), -10, 10)`` (veRL's).

    ``clamp`` (unset by default) bounds each token's estimate to ``[-clamp, clamp]`` for every
    estimator, on top of ``low_var_kl``'s own bound: k3 is exponential in the log ratio, and
    one token the reference finds wildly unlikely can otherwise dominate a batch.
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -log_r
    elif estimator == "abs":
        kl = log_r.abs()
    elif estimator in ("k2", "mse"):
        kl = 0.5 * log_r**2
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r  # expm1 is exact near 0, where the two terms cancel
    elif estimator == "low_var_kl":
        log_r = log_r.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        kl = (torch.expm1(log_r) - log_r).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
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
    clamp: float | None = None,
) -> torch.Tensor:
    """Token rewards with the KL penalty folded in: ``r_t - coef * KL_t`` on counted tokens.

    The classic RLHF shaping (Ouyang et al. 2022, "Training language models to follow
    instructions with human feedback", arXiv:2203.02155), feeding GAE or REINFORCE++. The penalty
    is a reward, so it is computed without gradient.
    """
    on = mask > 0
    logprobs = torch.where(on, logprobs.detach(), torch.zeros_like(logprobs))
    ref_logprobs = torch.where(on, ref_logprobs.detach(), torch.zeros_like(logprobs))
    return token_rewards - coef * kl_divergence(logprobs, ref_logprobs, estimator, clamp)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = "k3",
    agg: Aggregation = "token-mean",
    clamp: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a loss term (GRPO style): the per-token estimate, aggregated.

    ``aggregate_loss(kl_divergence(logprobs, ref, estimator, clamp), mask, agg, norm_length)``
    — the same aggregation as the policy loss. Multiply by the KL coefficient and add to the
    policy loss. Gradients flow into ``logprobs`` only. Metrics: ``kl`` (detached).
    """
    # Padding may hold -inf or junk: zero both sides there *before* the estimator, so no
    # inf reaches the graph (a `where` after it would still back-propagate 0 * inf = NaN).
    on = mask > 0
    logprobs = torch.where(on, logprobs, torch.zeros_like(logprobs))
    ref_logprobs = torch.where(on, ref_logprobs.detach(), torch.zeros_like(logprobs))
    kl = kl_divergence(logprobs, ref_logprobs, estimator, clamp)
    loss = aggregate_loss(kl, mask, agg, norm_length)
    return loss, {"kl": loss.detach()}
