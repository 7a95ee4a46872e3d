"""The RL objective of one step, assembled from ``relax.algos`` as ``[algorithm]`` says.

Advantages are computed once over the whole batch (group baselines and global whitening need
every row); the loss is then evaluated per micro-batch and weighted so that the accumulated
gradient equals the gradient of the whole-batch loss (see :func:`loss_denominator`). A rollout
correction that needs the whole batch (dropped tokens, batch-normalised weights) is computed
once before the micro-batches, from log-probs of a gradient-free pass
(:func:`correct_batch`); the others are computed per micro-batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from relax.algos import (
    RolloutCorrection,
    aggregate_loss,
    cispo_loss,
    decoupled_ppo_loss,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    gspo_loss,
    kl_divergence,
    kl_loss,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    rollout_correction,
    sequence_to_token_rewards,
)
from relax.config import AlgorithmConfig
from relax.errors import ConfigError, ConfigIssue
from relax.training._batch import Batch

Metrics = dict[str, torch.Tensor]


def check_supported(cfg: AlgorithmConfig) -> None:
    """Raise ``ConfigError`` for combinations this backend cannot compute faithfully.

    GSPO and CISPO have their own importance ratios and no slot for extra per-token weights,
    so stacking TIS/IcePop/decoupled corrections on them would silently do something else.
    AReaL's decoupled loss has no dual clip.
    """
    issues = []
    if cfg.loss != "ppo_clip" and cfg.off_policy != "none":
        issues.append(
            ConfigIssue(
                "algorithm.off_policy",
                f"off-policy correction {cfg.off_policy!r} is only implemented for"
                f" loss = 'ppo_clip', not {cfg.loss!r}",
                hint="use off_policy = 'none' or loss = 'ppo_clip'",
            )
        )
    if cfg.off_policy == "decoupled" and cfg.dual_clip is not None:
        issues.append(
            ConfigIssue(
                "algorithm.dual_clip",
                "dual_clip is not supported with off_policy = 'decoupled'",
                hint="unset dual_clip or choose another off_policy",
            )
        )
    if issues:
        raise ConfigError(issues)


def aggregation(cfg: AlgorithmConfig) -> str:
    """The aggregation every loss term uses: GSPO's is per sequence by definition."""
    return "seq-mean-token-mean" if cfg.loss == "gspo" else cfg.loss_aggregation


def loss_denominator(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """What a micro-batch's aggregated loss divides by: counted tokens, counted sequences, or
    (``"seq-mean-token-sum-norm"``) rows, whose other divisor is a constant.

    A micro-batch loss times ``its denominator / the batch's denominator`` sums, over
    micro-batches, to exactly the whole-batch loss for every aggregation.
    """
    if agg == "token-mean":
        return mask.sum().to(torch.float32)
    if agg == "seq-mean-token-sum-norm":
        # Explicit float32, like the other two: torch's default dtype is process-wide, and a
        # model being built in another thread (bf16, say) changes it for the duration.
        return torch.tensor(float(mask.shape[0]), dtype=torch.float32, device=mask.device)
    return (mask.sum(dim=-1) > 0).sum().to(torch.float32)


def correction_spec(cfg: AlgorithmConfig) -> RolloutCorrection:
    """The rollout correction ``[algorithm]`` asks for, the former ``off_policy`` names mapped
    onto ``[algorithm.rollout_correction]`` ("decoupled" is a loss of its own, not mapped)."""
    if cfg.off_policy == "tis":
        return RolloutCorrection(is_level="token", is_high=cfg.tis_cap)
    if cfg.off_policy == "icepop":
        return RolloutCorrection(
            is_level="token",
            is_mode="mask",
            is_low=1.0 / cfg.tis_cap,
            is_high=cfg.tis_cap,
            on_reject="zero_weight",
        )
    return RolloutCorrection(**cfg.rollout_correction.model_dump())


def correct_batch(
    batch: Batch, train_logprobs: torch.Tensor, cfg: AlgorithmConfig
) -> tuple[Batch, torch.Tensor | None, Metrics]:
    """The whole batch's rollout correction: ``(batch with dropped tokens unmasked, weights,
    metrics)``. ``train_logprobs`` ``[batch, seq - 1]`` are the trainer's log-probs before this
    step's update (a gradient-free pass)."""
    fix = rollout_correction(
        train_logprobs, batch.rollout_logprobs, batch.mask, correction_spec(cfg)
    )
    return replace(batch, mask=fix.mask), fix.weights, fix.metrics


def _reward_kl(batch: Batch, cfg: AlgorithmConfig) -> torch.Tensor | None:
    """Per-token ``coef * KL`` for ``kl.mode = "reward"``, or ``None``.

    Uses the rollout log-probs as the policy side: advantages are fixed before any forward
    pass of this step, and the rollout policy is the one that produced the tokens.
    """
    if cfg.kl.coef <= 0 or cfg.kl.mode != "reward":
        return None
    if batch.ref_logprobs is None:
        raise ValueError("algorithm.kl.coef > 0 needs rows with a 'ref_logprobs' column")
    kl = kl_divergence(batch.rollout_logprobs, batch.ref_logprobs, cfg.kl.estimator, cfg.kl.clamp)
    return cfg.kl.coef * torch.where(batch.mask > 0, kl, torch.zeros_like(kl))


def compute_advantages(batch: Batch, cfg: AlgorithmConfig) -> tuple[torch.Tensor, Metrics]:
    """Advantages for ``batch``: ``[batch]`` (group estimators) or ``[batch, seq - 1]``.

    With ``kl.mode = "reward"`` the penalty is folded in: per token for token estimators, and
    summed over the response for group estimators (whose rewards are per sequence).
    """
    rewards, mask, groups = batch.rewards, batch.mask, batch.group_ids
    kl_tok = _reward_kl(batch, cfg)
    seq_rewards = rewards if kl_tok is None else rewards - kl_tok.sum(dim=-1)
    kind = cfg.advantage
    if kind == "grpo":
        adv = grpo_advantages(seq_rewards, groups)
    elif kind == "dr_grpo":
        adv = dr_grpo_advantages(seq_rewards, groups)
    elif kind == "rloo":
        adv = rloo_advantages(seq_rewards, groups)
    elif kind == "reinforce_pp":
        # The "REINFORCE++-baseline" variant: group mean removed, then global whitening.
        adv = reinforce_pp_advantages(
            rewards, mask, group_ids=groups, kl_penalty=kl_tok, gamma=cfg.gamma
        )
    elif kind == "gae":
        if batch.values is None:
            raise ValueError(
                "advantage 'gae' needs rows with a 'values' column (critic values per"
                " response token); enable [critic] or pick a critic-free estimator"
            )
        token_rewards = sequence_to_token_rewards(rewards, mask)
        if kl_tok is not None:
            token_rewards = token_rewards - kl_tok
        adv, _ = gae_advantages(token_rewards, batch.values, mask, cfg.gamma, cfg.lam)
        adv = masked_whiten(adv, mask)
    else:  # pragma: no cover - the config's Literal rules this out
        raise ValueError(f"unknown advantage estimator {kind!r}")

    if adv.dim() == 1:
        stats = {"advantage_mean": adv.mean(), "advantage_std": adv.std(correction=0)}
    else:
        stats = {
            "advantage_mean": masked_mean(adv, mask),
            "advantage_std": masked_var(adv, mask, unbiased=False).sqrt(),
        }
    stats["reward_mean"] = rewards.mean()
    return adv.detach(), {k: v.detach() for k, v in stats.items()}


COUNT_PREFIX = "count:"
"""A micro-batch metric ``count:<name>`` says how many positions the mean ``<name>`` is over
(kept tokens, sequences, ...); ``<name>`` then combines over micro-batches (and ranks) as
``sum(count * mean) / sum(count)`` instead of by the micro-batch's share of the loss."""


def micro_batch_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: Batch,
    advantages: torch.Tensor,
    cfg: AlgorithmConfig,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """``(loss, policy_loss, metrics)`` of one micro-batch, aggregated within it.

    The old (proximal) policy is the model before this step's update. The backend takes one
    optimiser step per batch, so those log-probs equal ``logprobs.detach()`` from this very
    forward pass: no second pass is needed. The rollout log-probs are the behaviour policy.
    ``is_weights`` are the micro-batch's slice of a whole-batch correction
    (:func:`correct_batch`, whose dropped tokens are already out of ``mb.mask``); without it a
    correction that needs no other micro-batch is computed here.
    """
    mask, agg, norm = mb.mask, aggregation(cfg), cfg.loss_norm_length
    old = logprobs.detach()
    behaviour = mb.rollout_logprobs
    metrics: Metrics = {}
    spec = correction_spec(cfg)
    if is_weights is None and spec.active and not spec.needs_whole_batch:
        fix = rollout_correction(old, behaviour, mask, spec)
        is_weights, metrics = fix.weights, dict(fix.metrics)
        # Means over kept tokens or sequences: the batch's are the ratio of the sums.
        metrics.update({COUNT_PREFIX + key: n for key, n in fix.counts.items()})
    if cfg.loss == "ppo_clip":
        if cfg.off_policy == "decoupled":
            policy_loss, loss_metrics = decoupled_ppo_loss(
                logprobs,
                old,
                behaviour,
                advantages,
                mask,
                cfg.clip_low,
                cfg.clip_high,
                agg=agg,
                norm_length=norm,
            )
        else:
            policy_loss, loss_metrics = ppo_loss(
                logprobs,
                old,
                advantages,
                mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                dual_clip=cfg.dual_clip,
                agg=agg,
                is_weights=is_weights,
                norm_length=norm,
            )
    elif cfg.loss == "gspo":
        policy_loss, loss_metrics = gspo_loss(
            logprobs, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high
        )
    elif cfg.loss == "cispo":
        # The CISPO paper has no lower bound on the weight; honour clip_low only when set.
        low = cfg.clip_low if "clip_low" in cfg.model_fields_set else None
        policy_loss, loss_metrics = cispo_loss(
            logprobs,
            old,
            advantages,
            mask,
            clip_high=cfg.clip_high,
            clip_low=low,
            agg=agg,
            norm_length=norm,
        )
    else:  # pragma: no cover - the config's Literal rules this out
        raise ValueError(f"unknown policy loss {cfg.loss!r}")

    loss = policy_loss
    metrics.update(loss_metrics)
    # Training/inference mismatch: how far the trainer's log-probs of the sampled tokens are
    # from the sampler's. With fresh weights it is numerical noise; more means the two saw
    # different inputs (pixels, positions, masks) or weights.
    gap = torch.where(mask > 0, old - behaviour, torch.zeros_like(old))
    metrics["mismatch_max"] = gap.abs().max() if gap.numel() else gap.new_zeros(())
    metrics["mismatch_kl"] = masked_mean(torch.expm1(-gap) + gap, mask)
    if mb.ref_logprobs is not None:
        kl_term, kl_metrics = kl_loss(
            logprobs, mb.ref_logprobs, mask, cfg.kl.estimator, agg, cfg.kl.clamp, norm
        )
        metrics.update(kl_metrics)
        if cfg.kl.coef > 0 and cfg.kl.mode == "loss":
            loss = loss + cfg.kl.coef * kl_term
    elif cfg.kl.coef > 0:
        raise ValueError("algorithm.kl.coef > 0 needs rows with a 'ref_logprobs' column")
    if entropy is not None:
        entropy_agg = aggregate_loss(entropy, mask, agg, norm)
        metrics["entropy"] = entropy_agg.detach()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy_agg
    metrics["policy_loss"] = policy_loss.detach()
    return loss, policy_loss, {k: v.detach() for k, v in metrics.items()}
