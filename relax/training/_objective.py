"""The RL objective of one step, assembled from ``relax.algos`` as ``[algorithm]`` says.

Advantages are computed once over the whole batch (group baselines and global whitening need
every row); the loss is then evaluated per micro-batch and weighted so that the accumulated
gradient equals the gradient of the whole-batch loss (see :func:`loss_denominator`).
"""

from __future__ import annotations

import torch

from relax.algos import (
    aggregate_loss,
    cispo_loss,
    decoupled_ppo_loss,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    gspo_loss,
    kl_divergence,
    kl_loss,
    masked_is_weights,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
    tis_weights,
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
    return "sequence" if cfg.loss == "gspo" else cfg.aggregation


def loss_denominator(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """What a micro-batch's aggregated loss divides by: counted tokens or counted sequences.

    A micro-batch loss times ``its denominator / the batch's denominator`` sums, over
    micro-batches, to exactly the whole-batch loss for both aggregations.
    """
    if agg == "token":
        return mask.sum()
    return (mask.sum(dim=-1) > 0).sum().to(mask.dtype)


def _reward_kl(batch: Batch, cfg: AlgorithmConfig) -> torch.Tensor | None:
    """Per-token ``coef * KL`` for ``kl.mode = "reward"``, or ``None``.

    Uses the rollout log-probs as the policy side: advantages are fixed before any forward
    pass of this step, and the rollout policy is the one that produced the tokens.
    """
    if cfg.kl.coef <= 0 or cfg.kl.mode != "reward":
        return None
    if batch.ref_logprobs is None:
        raise ValueError("algorithm.kl.coef > 0 needs rows with a 'ref_logprobs' column")
    kl = kl_divergence(batch.rollout_logprobs, batch.ref_logprobs, cfg.kl.estimator)
    return cfg.kl.coef * kl * batch.mask


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


def micro_batch_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    mb: Batch,
    advantages: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """``(loss, policy_loss, metrics)`` of one micro-batch, aggregated within it.

    The old (proximal) policy is the model before this step's update. The backend takes one
    optimiser step per batch, so those log-probs equal ``logprobs.detach()`` from this very
    forward pass: no second pass is needed. The rollout log-probs are the behaviour policy.
    """
    mask, agg = mb.mask, aggregation(cfg)
    old = logprobs.detach()
    behaviour = mb.rollout_logprobs
    if cfg.loss == "ppo_clip":
        if cfg.off_policy == "decoupled":
            policy_loss, metrics = decoupled_ppo_loss(
                logprobs, old, behaviour, advantages, mask, cfg.clip_low, cfg.clip_high, agg=agg
            )
        else:
            weights = None
            if cfg.off_policy == "tis":
                weights = tis_weights(old, behaviour, mask, cap=cfg.tis_cap)
            elif cfg.off_policy == "icepop":
                weights = masked_is_weights(
                    old, behaviour, mask, low=1.0 / cfg.tis_cap, high=cfg.tis_cap
                )
            policy_loss, metrics = ppo_loss(
                logprobs,
                old,
                advantages,
                mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                dual_clip=cfg.dual_clip,
                agg=agg,
                is_weights=weights,
            )
            if weights is not None:
                metrics["is_weight_mean"] = masked_mean(weights, mask)
    elif cfg.loss == "gspo":
        policy_loss, metrics = gspo_loss(
            logprobs, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high
        )
    elif cfg.loss == "cispo":
        # The CISPO paper has no lower bound on the weight; honour clip_low only when set.
        low = cfg.clip_low if "clip_low" in cfg.model_fields_set else None
        policy_loss, metrics = cispo_loss(
            logprobs, old, advantages, mask, clip_high=cfg.clip_high, clip_low=low, agg=agg
        )
    else:  # pragma: no cover - the config's Literal rules this out
        raise ValueError(f"unknown policy loss {cfg.loss!r}")

    loss = policy_loss
    metrics = dict(metrics)
    # Training/inference mismatch: how far the trainer's log-probs of the sampled tokens are
    # from the sampler's. With fresh weights it is numerical noise; more means the two saw
    # different inputs (pixels, positions, masks) or weights.
    gap = torch.where(mask > 0, old - behaviour, torch.zeros_like(old))
    metrics["mismatch_max"] = gap.abs().max() if gap.numel() else gap.new_zeros(())
    metrics["mismatch_kl"] = masked_mean(torch.expm1(-gap) + gap, mask)
    if mb.ref_logprobs is not None:
        kl_term, kl_metrics = kl_loss(logprobs, mb.ref_logprobs, mask, cfg.kl.estimator, agg=agg)
        metrics.update(kl_metrics)
        if cfg.kl.coef > 0 and cfg.kl.mode == "loss":
            loss = loss + cfg.kl.coef * kl_term
    elif cfg.kl.coef > 0:
        raise ValueError("algorithm.kl.coef > 0 needs rows with a 'ref_logprobs' column")
    if entropy is not None:
        entropy_agg = aggregate_loss(entropy, mask, agg)
        metrics["entropy"] = entropy_agg.detach()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy_agg
    metrics["policy_loss"] = policy_loss.detach()
    return loss, policy_loss, {k: v.detach() for k, v in metrics.items()}
