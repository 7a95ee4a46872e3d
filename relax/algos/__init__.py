"""Relax's RL algorithms: pure tensor functions (torch only), one paper each.

Shapes: per-token tensors are ``[batch, seq]`` with a ``mask`` (1 on response tokens that count);
per-sample tensors are ``[batch]``; ``group_ids`` ``[batch]`` names each sample's prompt group.
Losses return ``(loss, metrics)`` with detached 0-d tensor metrics. ``docs/algorithms.md`` lists
every estimator, loss, aggregation, KL estimator and correction with its formula and paper.
"""

from relax.algos._advantages import (
    discounted_returns,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    gae_advantages,
    group_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_rewards,
)
from relax.algos._correction import (
    Correction,
    ISLevel,
    ISMode,
    OnReject,
    RolloutCorrection,
    batch_normalize,
    level_log_ratio,
    rollout_correction,
    rollout_log_ratio,
    sequence_kl,
)
from relax.algos._kl import KLEstimator, kl_divergence, kl_loss, kl_reward_penalty
from relax.algos._losses import (
    Metrics,
    cispo_loss,
    entropy_bonus,
    entropy_from_logits,
    gspo_loss,
    logprobs_from_logits,
    ppo_loss,
)
from relax.algos._masked import (
    AGGREGATION_ALIASES,
    Aggregation,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from relax.algos._offpolicy import decoupled_ppo_loss, masked_is_weights, tis_weights
from relax.algos._passk import mean_pass_at_k, pass_at_k

__all__ = [
    "AGGREGATION_ALIASES",
    "Aggregation",
    "Correction",
    "ISLevel",
    "ISMode",
    "KLEstimator",
    "Metrics",
    "OnReject",
    "RolloutCorrection",
    "aggregate_loss",
    "batch_normalize",
    "cispo_loss",
    "decoupled_ppo_loss",
    "discounted_returns",
    "dr_grpo_advantages",
    "dynamic_sampling_mask",
    "entropy_bonus",
    "entropy_from_logits",
    "gae_advantages",
    "group_stats",
    "grpo_advantages",
    "gspo_loss",
    "kl_divergence",
    "kl_loss",
    "kl_reward_penalty",
    "level_log_ratio",
    "logprobs_from_logits",
    "masked_is_weights",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mean_pass_at_k",
    "pass_at_k",
    "ppo_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "rollout_correction",
    "rollout_log_ratio",
    "sequence_kl",
    "sequence_to_token_rewards",
    "tis_weights",
]
