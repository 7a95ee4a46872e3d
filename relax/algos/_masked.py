"""Masked reductions shared by every estimator and loss.

Per-token tensors are ``[batch, seq]`` with a ``mask`` that is 1 on response tokens that count and
0 elsewhere (prompt, padding, tool output). Every reduction here divides by the number of *counted*
tokens, never by ``seq``, and an all-zero mask yields 0 rather than NaN so an empty micro-batch
cannot poison a step.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal[
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token",
    "sequence",
]
"""veRL's four loss aggregation modes, plus Relax's first names for two of them."""

AGGREGATION_ALIASES: dict[str, str] = {"token": "token-mean", "sequence": "seq-mean-token-mean"}
"""Relax's first names: ``"token"`` is ``"token-mean"``, ``"sequence"`` is
``"seq-mean-token-mean"`` (exactly the same reductions)."""


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is 1, over ``dim`` (all dims when ``None``)."""
    # Multiply rather than index so masked positions still receive an (exactly zero) gradient.
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1; 0 where nothing is counted."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all counted positions (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        # Bessel's correction n/(n-1); with one or zero counted elements the variance is 0.
        var = var * count / (count - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over counted positions.

    Statistics are global over the whole batch (as in PPO/REINFORCE++ advantage whitening).
    With ``shift_mean=False`` the mean is added back, rescaling only. Masked positions are 0.
    When every counted value is exactly equal there is nothing to normalise: the result is
    exactly 0 (or that value, with ``shift_mean=False``) — the rounded mean would otherwise
    leave noise that ``rsqrt(var + eps)`` scales up by ``1/sqrt(eps)``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    counted = mask > 0
    top = torch.where(counted, x, torch.full_like(x, -torch.inf)).amax()
    bottom = torch.where(counted, x, torch.full_like(x, torch.inf)).amin()
    constant = top == bottom  # a tensor, not a bool: no device sync
    whitened = torch.where(constant, torch.zeros_like(x), (x - mean) * torch.rsqrt(var + eps))
    if not shift_mean:
        whitened = whitened + torch.where(constant, top, mean)
    return whitened * mask


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    agg: Aggregation = "token-mean",
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[batch, seq]`` to a scalar; veRL's ``loss_agg_mode`` names.

    With ``m`` the mask, ``l`` the loss, ``n_i = sum_t m_it`` and ``S`` the sequences with
    ``n_i > 0``:

    - ``"token-mean"`` (alias ``"token"``): ``sum_it m l / sum_i n_i`` — every counted token of
      the batch weighs the same, so long responses weigh more (DAPO's token-level loss, Yu et
      al. 2025, arXiv:2503.14476).
    - ``"seq-mean-token-mean"`` (alias ``"sequence"``): ``mean_{i in S} (sum_t m l / n_i)`` —
      the original GRPO normalisation (Shao et al. 2024, arXiv:2402.03300).
    - ``"seq-mean-token-sum"``: ``mean_{i in S} sum_t m l`` — no length normalisation.
    - ``"seq-mean-token-sum-norm"``: ``sum_it m l / (B * norm_length)`` with ``B`` the number
      of rows of ``loss_mat`` (all of them, counted tokens or not) and ``norm_length`` a
      constant — Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
      arXiv:2503.20783, which divides each response's token sum by the generation budget
      ``MAX_TOKENS`` and averages over the batch). Neither divisor depends on the mask, so a
      token's weight never depends on its response's length or on which tokens are masked.
      veRL divides by ``loss_scale_factor`` alone (no ``B``); ``norm_length = f / B`` matches it.

    Sequences with no counted token are left out of the sequence means (and add nothing to the
    sums). An all-zero mask gives 0.
    """
    agg = AGGREGATION_ALIASES.get(agg, agg)  # type: ignore[assignment]
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    if agg == "seq-mean-token-sum-norm":
        if norm_length is None or not norm_length > 0:
            raise ValueError(f"seq-mean-token-sum-norm needs a norm_length > 0, got {norm_length}")
        rows = max(loss_mat.shape[0], 1)
        return masked_sum(loss_mat, mask) / (rows * norm_length)
    has_tokens = (mask.sum(dim=-1) > 0).to(loss_mat.dtype)
    if agg == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    elif agg == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return masked_mean(per_seq, has_tokens)
