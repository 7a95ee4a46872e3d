"""Relax's RL algorithms: pure tensor functions (torch only), one paper each.

Shapes: per-token tensors are ``[batch, seq]`` with a ``mask`` (1 on response tokens that count);
per-sample tensors are ``[batch]``; ``group_ids`` ``[batch]`` names each sample's prompt group.
Losses return ``(loss, metrics)`` with detached 0-d tensor metrics.
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
    Aggregation,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from relax.algos._offpolicy import decoupled_ppo_loss, masked_is_weights, tis_weights

__all__ = [
    "Aggregation",
    "KLEstimator",
    "Metrics",
    "aggregate_loss",
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
    "logprobs_from_logits",
    "masked_is_weights",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_to_token_rewards",
    "tis_weights",
]
