"""Masks may arrive as float, int or bool tensors; every function must treat them alike."""

from __future__ import annotations

import pytest
import torch

import relax.algos as algos

GEN = torch.Generator().manual_seed(0)
LOGP = -torch.rand(3, 4, generator=GEN)
OLD = LOGP + 0.1 * torch.randn(3, 4, generator=GEN)
VALUES = torch.randn(3, 4, generator=GEN)
ADV = torch.randn(3, generator=GEN)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]])
GROUPS = torch.tensor([0, 0, 1])

_EVERY_RULE = algos.RolloutCorrection(
    "geometric", is_high=1.2, is_batch_normalize=True, reject_token_high=1.1, reject_seq_k3=0.01
)

CALLS = {
    "whiten": lambda m: algos.masked_whiten(VALUES, m),
    "ppo": lambda m: algos.ppo_loss(LOGP, OLD, ADV, m, agg="sequence")[0],
    "gspo": lambda m: algos.gspo_loss(LOGP, OLD, ADV, m, clip_low=0.2, clip_high=0.2)[0],
    "cispo": lambda m: algos.cispo_loss(LOGP, OLD, ADV, m)[0],
    "gae": lambda m: algos.gae_advantages(VALUES, VALUES.flip(-1), m, 0.9, 0.95)[0],
    "reinforce_pp": lambda m: algos.reinforce_pp_advantages(ADV, m, GROUPS),
    "kl": lambda m: algos.kl_loss(LOGP, OLD, m)[0],
    "tis": lambda m: algos.tis_weights(LOGP, OLD, m),
    "decoupled": lambda m: algos.decoupled_ppo_loss(LOGP, OLD, OLD + 0.1, ADV, m)[0],
    "norm_aggregation": lambda m: algos.aggregate_loss(VALUES, m, "seq-mean-token-sum-norm", 3.0),
    "correction": lambda m: algos.rollout_correction(LOGP, OLD, m, _EVERY_RULE).weights,
    "correction_mask": lambda m: algos.rollout_correction(LOGP, OLD, m, _EVERY_RULE).mask.float(),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_mask_dtypes_agree(name: str) -> None:
    call = CALLS[name]
    expected = call(MASK.float())
    torch.testing.assert_close(call(MASK), expected)
    torch.testing.assert_close(call(MASK.bool()), expected)
