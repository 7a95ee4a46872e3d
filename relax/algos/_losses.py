"""Policy-gradient losses: PPO-clip (asymmetric and dual clip), GSPO, CISPO; entropy.

Every loss takes per-token ``logprobs`` of the policy being trained ``[batch, seq]`` (carrying the
gradient), the ``old_logprobs`` the advantages were estimated under, ``advantages`` either per
sample ``[batch]`` or per token ``[batch, seq]``, and the response ``mask``. It returns
``(loss, metrics)``: a scalar to minimise and a dict of detached 0-d tensors for logging
(call ``.item()`` when writing them out; they stay on device to avoid a sync per step).
"""

from __future__ import annotations

import torch

from relax.algos._masked import Aggregation, aggregate_loss, masked_mean, masked_sum

Metrics = dict[str, torch.Tensor]


def _log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``logp - old`` on counted tokens and 0 elsewhere.

    ``where`` (not multiplication) so padding holding ``-inf`` or garbage cannot turn into NaN in
    the loss or its gradient.
    """
    return torch.where(mask > 0, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample advantages ``[batch]`` over tokens; pass ``[batch, seq]`` through."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """KL(old || new) two ways and ratio statistics, over counted tokens.

    With ``log_ratio = logp - old`` (tokens sampled from ``old``; Schulman 2020, "Approximating
    KL Divergence", http://joschu.net/blog/kl-approx.html): ``approx_kl`` is the masked token
    mean of k3, ``(r - 1) - log r``, and ``ppo_kl`` veRL's masked token mean of k1,
    ``old - logp``.
    """
    log_ratio = log_ratio.detach()
    ratio = log_ratio.exp()
    # Ratios are positive, so zeroing masked positions keeps them out of the max.
    ratio_max = torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max()
    return {
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": ratio_max,
    }


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: Aggregation = "token-mean",
    is_weights: torch.Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate loss with asymmetric and dual clipping.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347:
    ``L = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)`` with ``r = exp(logp - old)``.

    - ``clip_high`` larger than ``clip_low`` is DAPO's "clip-higher", which leaves room for
      low-probability tokens to grow and so fights entropy collapse (Yu et al. 2025,
      arXiv:2503.14476). ``None`` means symmetric.
    - ``dual_clip = c > 1`` bounds the loss of negative-advantage tokens by ``-c * A`` so a huge
      ratio on a bad token cannot blow up the update (Ye et al. 2020, "Mastering Complex Control
      in MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729): for ``A < 0`` the
      token loss is ``min(L, -c * A)``. ``None`` (the default) disables it; veRL always applies
      it, with ``clip_ratio_c = 3.0`` by default.
    - ``is_weights`` (``[batch, seq]``, treated as constants) multiply each token's loss; this is
      how off-policy corrections (TIS, masked IS, AReaL's behaviour weight) plug in.
    - ``agg`` and ``norm_length``: how token losses become one number (``aggregate_loss``).

    Metrics: ``clip_frac`` (tokens where the clipped branch was chosen), ``dual_clip_frac``,
    ``approx_kl``, ``ppo_kl``, ``ratio_mean``, ``ratio_max``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    adv = _per_token(advantages, logprobs).detach()
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = log_ratio.exp()

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": masked_mean((clipped > unclipped).float(), mask)}

    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        capped = torch.minimum(loss_mat, -adv * dual_clip)
        dual_active = (adv < 0) & (loss_mat > capped)
        loss_mat = torch.where(adv < 0, capped, loss_mat)
        metrics["dual_clip_frac"] = masked_mean(dual_active.float(), mask)

    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()

    metrics.update(_ratio_metrics(log_ratio, mask))
    return aggregate_loss(loss_mat, mask, agg, norm_length), metrics


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: PPO-clip on a sequence-level, length-normalised importance ratio.

    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071:
    ``s_i = exp(mean_t(logp_t - old_t))`` and
    ``L = mean_i -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)``.
    The ratio is one per sequence, so the clip accepts or rejects whole responses and the noisy
    per-token ratios of long sequences (and MoE routing changes) average out. Default clip
    ranges are the paper's (3e-4, 4e-4). Implemented in the paper's GSPO-token form,
    ``s_i,t = sg[s_i] * pi_t / sg[pi_t]``, which has the same value and gradient as GSPO for
    sequence advantages and also accepts per-token advantages ``[batch, seq]``.

    The loss is aggregated ``"seq-mean-token-mean"``, the paper's ``1/G sum_i 1/|y_i| sum_t``.

    Metrics: ``clip_frac_seq`` (= ``clip_frac``), the fraction of sequences (with counted
    tokens) that have a clipped token — with per-sequence advantages, the fraction of sequences
    clipped; ``clip_frac_token``, the fraction of counted tokens clipped (the paper's Figure 4
    reports this one); plus the ratio metrics of the per-token ratios and ``seq_ratio_mean``.
    """
    adv = _per_token(advantages, logprobs).detach()
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # [batch]
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = token_log_ratio.exp()

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)

    has_tokens = (mask.sum(dim=-1) > 0).float()
    token_clipped = (clipped > unclipped).float()
    seq_clipped = (masked_sum(token_clipped, mask, dim=-1) > 0).float()
    clip_frac_seq = masked_mean(seq_clipped, has_tokens)
    metrics = {
        "clip_frac": clip_frac_seq,
        "clip_frac_seq": clip_frac_seq,
        "clip_frac_token": masked_mean(token_clipped, mask),
    }
    metrics.update(_ratio_metrics(log_ratio, mask))
    metrics["seq_ratio_mean"] = masked_mean(seq_log_ratio.detach().exp(), has_tokens)
    return aggregate_loss(loss_mat, mask, "seq-mean-token-mean"), metrics


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_high: float = 0.28,
    clip_low: float | None = None,
    agg: Aggregation = "token-mean",
    norm_length: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv:2506.13585, §3.1: ``L = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * logp``.
    Unlike PPO, clipping the *weight* never removes a token's gradient, so rare "fork" tokens
    with large ratios still learn. The paper sets no lower bound (``clip_low=None``) and averages
    over all tokens in the batch (``agg="token-mean"``).

    Metrics: ``clip_frac`` (tokens whose weight was clipped) plus the ratio metrics.
    """
    adv = _per_token(advantages, logprobs).detach()
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = log_ratio.detach().exp()
    low = None if clip_low is None else 1 - clip_low
    weight = ratio.clamp(min=low, max=1 + clip_high)
    safe_logprobs = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))
    loss_mat = -weight * adv * safe_logprobs

    metrics = {"clip_frac": masked_mean((weight != ratio).float(), mask)}
    metrics.update(_ratio_metrics(log_ratio, mask))
    return aggregate_loss(loss_mat, mask, agg, norm_length), metrics


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``token_ids`` ``[batch, seq]`` under ``logits`` ``[batch, seq, vocab]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy ``H = logsumexp(z) - sum softmax(z) * z`` of ``[..., vocab]`` logits.

    This form never takes ``log(0)``, so it stays finite for peaked distributions.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_bonus(
    logits: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 0.01,
    agg: Aggregation = "token-mean",
    norm_length: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Entropy bonus as a loss term: ``-coef * aggregate_loss(H, mask, agg, norm_length)``.

    Add it to the policy loss to discourage premature entropy collapse (Mnih et al. 2016,
    "Asynchronous Methods for Deep Reinforcement Learning", arXiv:1602.01783; used in PPO).
    Metrics: ``entropy`` (the aggregated, detached entropy).
    """
    entropy = aggregate_loss(entropy_from_logits(logits), mask, agg, norm_length)
    return -coef * entropy, {"entropy": entropy.detach()}
