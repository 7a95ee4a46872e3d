"""Rollout correction: importance weights and rejection sampling for off-policy tokens.

In asynchronous RL the tokens were sampled by the rollout policy ``pi_rollout`` (another
engine, another precision and, with ``staleness > 0``, older weights) while the loss is taken
under the training policy ``pi_train`` (the trainer's log-probs of the same tokens, before this
step's update). Everything here starts from the per-token log ratio on counted tokens

    ``lr_t = log pi_train(y_t) - log pi_rollout(y_t)``  (0 where ``mask`` is 0)

and is a constant of the step (no gradient). Two families, combinable:

- **Importance weights** (``is_level``), ``w = pi_train / pi_rollout`` at one of three levels:
  ``"token"`` ``w_t = exp(lr_t)`` (TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl); ``"sequence"``
  ``w_i = exp(sum_t lr_t)``, the product of the token ratios (the unbiased sequence-level
  weight); ``"geometric"`` ``w_i = exp(mean_t lr_t)``, their geometric mean (length-invariant).
  Then either ``"truncate"``: ``w = min(w, high)`` (TIS; IMPALA's truncation, Espeholt et al.
  2018, arXiv:1802.01561), or ``"mask"``: a token (token level) or whole sequence whose weight
  is outside ``[low, high]`` is rejected (masked IS, MIS: Liu, Li et al. 2025, "When Speed
  Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch",
  richardli.xyz/rl-collapse; IcePop: Ling Team 2025, arXiv:2510.18855). Optionally the kept
  weights are divided by their batch mean (over tokens at token level, over sequences at
  sequence levels), so they average exactly 1.
- **Rejection sampling**, after veRL's rollout correction (``docs/algo/rollout_corr.md`` and
  ``rollout_corr_math.md`` in volcengine/verl): a token whose ratio ``exp(lr_t)`` is outside
  ``[reject_token_low, reject_token_high]``; a whole sequence whose mean k1, ``mean_t -lr_t``,
  or mean k3, ``mean_t (exp(lr_t) - 1 - lr_t)`` (Schulman 2020, "Approximating KL Divergence",
  estimating KL(pi_rollout || pi_train) from the rollout's samples) exceeds a threshold; a
  whole sequence whose geometric-mean ratio ``exp(mean_t lr_t)`` is outside
  ``[reject_geo_low, reject_geo_high]``.

A rejected token either leaves the loss mask (``on_reject = "drop"``: it leaves the
denominator of every aggregation — policy loss, KL and entropy — as if it were not there) or
stays counted with importance weight 0 in the policy loss (``"zero_weight"``: IcePop as Relax
first built it, ``off_policy = "icepop"``). Bounds are inclusive; a bound left ``None`` is open.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from relax.algos._masked import masked_mean

ISLevel = Literal["none", "token", "sequence", "geometric"]
ISMode = Literal["truncate", "mask"]
OnReject = Literal["drop", "zero_weight"]


@dataclass(frozen=True)
class RolloutCorrection:
    """What to correct; the fields of ``[algorithm.rollout_correction]`` (see the module doc)."""

    is_level: ISLevel = "none"
    is_mode: ISMode = "truncate"
    is_high: float = 2.0
    is_low: float | None = None
    is_batch_normalize: bool = False
    reject_token_low: float | None = None
    reject_token_high: float | None = None
    reject_seq_k1: float | None = None
    reject_seq_k3: float | None = None
    reject_geo_low: float | None = None
    reject_geo_high: float | None = None
    on_reject: OnReject = "drop"

    @property
    def weighs(self) -> bool:
        """Whether importance weights are computed."""
        return self.is_level != "none"

    @property
    def rejects(self) -> bool:
        """Whether any rule can reject a token."""
        bounds = (
            self.reject_token_low,
            self.reject_token_high,
            self.reject_seq_k1,
            self.reject_seq_k3,
            self.reject_geo_low,
            self.reject_geo_high,
        )
        return (self.weighs and self.is_mode == "mask") or any(b is not None for b in bounds)

    @property
    def active(self) -> bool:
        """Whether this changes the loss at all."""
        return self.weighs or self.rejects

    @property
    def needs_whole_batch(self) -> bool:
        """Whether the result of one micro-batch depends on the others' log-probs: a batch
        mean of the weights, or dropped tokens (which change the aggregation's denominator)."""
        normalises = self.weighs and self.is_batch_normalize
        return normalises or (self.rejects and self.on_reject == "drop")


class Correction(NamedTuple):
    """What ``rollout_correction`` returns."""

    weights: torch.Tensor | None
    """``[batch, seq]`` importance weights for ``ppo_loss(is_weights=...)``, or ``None``."""
    mask: torch.Tensor
    """The loss mask with dropped tokens removed (``mask`` itself when nothing is dropped)."""
    metrics: dict[str, torch.Tensor]
    """``is_weight_mean``/``is_weight_max`` (kept tokens), ``is_batch_norm_factor``,
    ``rejected_token_frac`` (of counted tokens), ``rejected_seq_frac`` (of sequences with
    counted tokens, those left with none); detached 0-d tensors."""
    counts: dict[str, torch.Tensor]
    """How many positions each mean of ``metrics`` is over (kept tokens, counted tokens,
    sequences with counted tokens): corrections computed per micro-batch combine into the
    batch's means by them."""


def rollout_log_ratio(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log pi_train - log pi_rollout`` on counted tokens, 0 elsewhere, without gradient.

    ``where`` (not multiplication) so garbage or ``-inf`` in padding cannot leak as NaN.
    """
    lr = (train_logprobs - rollout_logprobs).detach()
    return torch.where(mask > 0, lr, torch.zeros_like(lr))


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: ISLevel) -> torch.Tensor:
    """The log ratio at ``level``, ``[batch, seq]``: per token ``lr_t`` (TIS, Yao et al. 2025);
    per sequence ``sum_t lr_t`` (``"sequence"``: the log of the product of token ratios) or
    ``mean_t lr_t`` (``"geometric"``: the log of their geometric mean, length-invariant, as in
    GSPO's ratio, Zheng et al. 2025, arXiv:2507.18071) on every position of the row."""
    if level == "token":
        return log_ratio
    counted = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    if level == "sequence":
        per_seq = counted.sum(dim=-1)
    elif level == "geometric":
        per_seq = masked_mean(counted, mask > 0, dim=-1)
    else:
        raise ValueError(f"unknown importance-weight level {level!r}")
    return per_seq.unsqueeze(-1).expand_as(log_ratio)


def within(values: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """Bool: ``low <= values <= high``, a ``None`` bound being open."""
    keep = torch.ones_like(values, dtype=torch.bool)
    if low is not None:
        keep &= values >= low
    if high is not None:
        keep &= values <= high
    return keep


def sequence_kl(
    log_ratio: torch.Tensor, mask: torch.Tensor, estimator: Literal["k1", "k3"]
) -> torch.Tensor:
    """Per sequence ``[batch]``: the mean over counted tokens of k1 ``-lr`` or k3
    ``exp(lr) - 1 - lr``, estimates of KL(pi_rollout || pi_train) from the rollout's samples
    (Schulman 2020, "Approximating KL Divergence"; veRL's ``seq_mean_k1`` / ``seq_mean_k3``
    rejection statistics). 0 for an empty row."""
    kl = -log_ratio if estimator == "k1" else torch.expm1(log_ratio) - log_ratio
    kl = torch.where(mask > 0, kl, torch.zeros_like(kl))
    return masked_mean(kl, mask > 0, dim=-1)


def batch_normalize(
    weights: torch.Tensor, kept: torch.Tensor, per_sequence: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights / mean, mean)``, the mean over kept tokens, or over sequences with a kept
    token when every token of a sequence carries the sequence's weight (veRL's
    ``rollout_is_batch_normalize``, ``docs/algo/rollout_corr_math.md`` §3.6): the weights then
    average exactly 1. A mean of 0 (nothing kept) leaves the weights as they are."""
    if per_sequence:
        seq_w = masked_mean(weights, kept, dim=-1)
        mean = masked_mean(seq_w, kept.any(dim=-1))
    else:
        mean = masked_mean(weights, kept)
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))
    return weights / safe, mean


def _reject(log_ratio: torch.Tensor, mask: torch.Tensor, spec: RolloutCorrection) -> torch.Tensor:
    """Bool ``[batch, seq]``: tokens no rejection rule removes (True on padding too)."""
    keep = within(log_ratio.exp(), spec.reject_token_low, spec.reject_token_high)
    for estimator, threshold in (("k1", spec.reject_seq_k1), ("k3", spec.reject_seq_k3)):
        if threshold is not None:
            keep &= (sequence_kl(log_ratio, mask, estimator) <= threshold).unsqueeze(-1)
    if spec.reject_geo_low is not None or spec.reject_geo_high is not None:
        geo = level_log_ratio(log_ratio, mask, "geometric").exp()
        keep &= within(geo, spec.reject_geo_low, spec.reject_geo_high)
    return keep


def _masked_max(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Max of non-negative ``values`` where ``keep`` holds; 0 when it holds nowhere."""
    picked = torch.where(keep, values, torch.zeros_like(values))
    return picked.max() if picked.numel() else picked.new_zeros(())


def rollout_correction(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    spec: RolloutCorrection,
) -> Correction:
    """Importance weights and rejections of one batch, as ``spec`` says (see the module doc).

    Order: weights at ``spec.is_level``; truncated at ``is_high`` or, in ``"mask"`` mode,
    rejected outside ``[is_low, is_high]`` (``is_low`` defaults to ``1 / is_high``); the
    rejection rules; then, over what is kept, the optional batch normalisation. Weights are 0
    on rejected tokens and padding. Token ``t`` of row ``i`` counts when ``mask[i, t] > 0``.
    """
    counted = mask > 0
    lr = rollout_log_ratio(train_logprobs, rollout_logprobs, mask)
    keep = _reject(lr, mask, spec)
    weights = None
    if spec.weighs:
        weights = level_log_ratio(lr, mask, spec.is_level).exp()
        if spec.is_mode == "truncate":
            weights = weights.clamp(max=spec.is_high)
        else:
            low = 1.0 / spec.is_high if spec.is_low is None else spec.is_low
            keep &= within(weights, low, spec.is_high)
    kept = counted & keep

    metrics: dict[str, torch.Tensor] = {}
    if weights is not None:
        weights = torch.where(kept, weights, torch.zeros_like(weights))
        if spec.is_batch_normalize:
            weights, mean = batch_normalize(weights, kept, spec.is_level != "token")
            metrics["is_batch_norm_factor"] = mean
        metrics["is_weight_mean"] = masked_mean(weights, kept)
        metrics["is_weight_max"] = _masked_max(weights, kept)
    has_tokens = counted.any(dim=-1)
    emptied = has_tokens & ~kept.any(dim=-1)
    metrics["rejected_token_frac"] = masked_mean((counted & ~keep).to(lr.dtype), counted)
    metrics["rejected_seq_frac"] = masked_mean(emptied.to(lr.dtype), has_tokens)
    counts = {"rejected_token_frac": counted.sum(), "rejected_seq_frac": has_tokens.sum()}
    if weights is not None:
        counts["is_weight_mean"] = kept.sum()

    if spec.on_reject == "zero_weight":
        if weights is None and spec.rejects:
            weights = kept.to(lr.dtype)
        return Correction(weights, mask, metrics, counts)
    dropped_mask = torch.where(kept, mask, torch.zeros_like(mask))
    return Correction(weights, dropped_mask, metrics, counts)
