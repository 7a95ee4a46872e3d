"""Masked reductions shared by every estimator and loss.

Per-token tensors are ``[batch, seq]`` with a ``mask`` that is 1 on response tokens that count and
0 elsewhere (prompt, padding, tool output). Every reduction here divides by the number of *counted*
tokens, never by ``seq``, and an all-zero mask yields 0 rather than NaN so an empty micro-batch
cannot poison a step.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token", "sequence", "seq-mean-token-sum"]


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
    loss_mat: torch.Tensor, mask: torch.Tensor, agg: Aggregation = "token"
) -> torch.Tensor:
    """Reduce a per-token loss ``[batch, seq]`` to a scalar.

    - ``"token"``: mean over every counted token in the batch, so long responses weigh more
      (DAPO's token-level loss, Yu et al. 2025, arXiv:2503.14476).
    - ``"sequence"``: mean over each sequence's tokens, then mean over sequences (the original
      GRPO normalisation, Shao et al. 2024, arXiv:2402.03300).
    - ``"seq-mean-token-sum"``: sum over each sequence's tokens, then mean over sequences — no
      length normalisation (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).

    Sequences with no counted token are left out of the sequence means.
    """
    if agg == "token":
        return masked_mean(loss_mat, mask)
    has_tokens = (mask.sum(dim=-1) > 0).to(loss_mat.dtype)
    if agg == "sequence":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    elif agg == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return masked_mean(per_seq, has_tokens)
