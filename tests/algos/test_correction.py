"""Rollout correction: importance weights (token, sequence, geometric; truncated or masked;
batch-normalised) and rejection sampling, against plain-Python loops on junk-padded batches."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algos import (
    RolloutCorrection,
    masked_is_weights,
    ppo_loss,
    rollout_correction,
    tis_weights,
)
from tests.algos.reference import Ragged, counted, ragged

LN = math.log


def _within(x: float, low: float | None, high: float | None) -> bool:
    return (low is None or x >= low) and (high is None or x <= high)


def reference(r: Ragged, spec: RolloutCorrection) -> tuple[list, list, dict]:
    """``(weights, mask, metrics)`` by hand: lists of rows, weights ``None`` when not weighed."""
    weights, keeps = [], []
    for i in range(len(r.mask)):
        lrs = [a - b for a, b in zip(counted(r, "train", i), counted(r, "rollout", i), strict=True)]
        n = len(lrs)
        seq_sum = sum(lrs)
        seq_mean = seq_sum / n if n else 0.0
        keep = [_within(math.exp(x), spec.reject_token_low, spec.reject_token_high) for x in lrs]
        if spec.reject_seq_k1 is not None and n and sum(-x for x in lrs) / n > spec.reject_seq_k1:
            keep = [False] * n
        k3 = sum(math.exp(x) - 1 - x for x in lrs) / n if n else 0.0
        if spec.reject_seq_k3 is not None and k3 > spec.reject_seq_k3:
            keep = [False] * n
        if not _within(math.exp(seq_mean), spec.reject_geo_low, spec.reject_geo_high):
            keep = [False] * n
        w = []
        if spec.is_level != "none":
            level = {"sequence": seq_sum, "geometric": seq_mean}
            w = [math.exp(level.get(spec.is_level, x)) for x in lrs]
            if spec.is_mode == "truncate":
                w = [min(x, spec.is_high) for x in w]
            else:
                low = spec.is_low if spec.is_low is not None else 1 / spec.is_high
                keep = [k and _within(x, low, spec.is_high) for k, x in zip(keep, w, strict=True)]
            w = [x if k else 0.0 for x, k in zip(w, keep, strict=True)]
        weights.append(w)
        keeps.append(keep)

    metrics: dict[str, float] = {}
    if spec.is_level != "none":
        kept_w = [
            x for w, k in zip(weights, keeps, strict=True) for x, kk in zip(w, k, strict=True) if kk
        ]
        if spec.is_batch_normalize:
            if spec.is_level == "token":
                mean = sum(kept_w) / len(kept_w)
            else:  # one weight per sequence that kept a token
                per_seq = [w[k.index(True)] for w, k in zip(weights, keeps, strict=True) if any(k)]
                mean = sum(per_seq) / len(per_seq)
            weights = [[x / mean for x in w] for w in weights]
            kept_w = [x / mean for x in kept_w]
            metrics["is_batch_norm_factor"] = mean
        metrics["is_weight_mean"] = sum(kept_w) / len(kept_w)
        metrics["is_weight_max"] = max(kept_w)
    all_keeps = [k for row in keeps for k in row]
    metrics["rejected_token_frac"] = all_keeps.count(False) / len(all_keeps)
    with_tokens = [row for row in keeps if row]
    metrics["rejected_seq_frac"] = sum(not any(row) for row in with_tokens) / len(with_tokens)

    # Back to padded rows: counted positions in order.
    out_w, out_mask = [], []
    for i, row in enumerate(r.mask):
        it_w, it_k = iter(weights[i]), iter(keeps[i])
        w_row, m_row = [], []
        for m in row:
            if m:
                k = next(it_k)
                w_row.append(next(it_w) if spec.is_level != "none" else float(k))
                m_row.append(1.0 if (k or spec.on_reject == "zero_weight") else 0.0)
            else:
                w_row.append(0.0)
                m_row.append(0.0)
        out_w.append(w_row)
        out_mask.append(m_row)
    has_weights = spec.is_level != "none" or (spec.on_reject == "zero_weight" and spec.rejects)
    return (out_w if has_weights else None), out_mask, metrics


SPECS = {
    "tis": RolloutCorrection(is_level="token", is_high=1.3),
    "seq-truncate": RolloutCorrection(is_level="sequence", is_high=1.5),
    "geo-truncate-norm": RolloutCorrection(
        is_level="geometric", is_high=1.1, is_batch_normalize=True
    ),
    "token-mask-drop": RolloutCorrection(is_level="token", is_mode="mask", is_low=0.7, is_high=1.4),
    "seq-mask-zero": RolloutCorrection(
        is_level="sequence", is_mode="mask", is_low=0.7, is_high=1.5, on_reject="zero_weight"
    ),
    "geo-mask-norm": RolloutCorrection(
        is_level="geometric", is_mode="mask", is_high=1.2, is_batch_normalize=True
    ),
    "token-norm": RolloutCorrection(is_level="token", is_high=1.5, is_batch_normalize=True),
    "reject-token": RolloutCorrection(reject_token_low=0.8, reject_token_high=1.25),
    "reject-k1": RolloutCorrection(reject_seq_k1=0.05),
    "reject-k3-zero": RolloutCorrection(reject_seq_k3=0.05, on_reject="zero_weight"),
    "reject-geo": RolloutCorrection(reject_geo_low=0.9, reject_geo_high=1.1),
    "everything": RolloutCorrection(
        is_level="token",
        is_high=1.6,
        is_batch_normalize=True,
        reject_token_high=1.7,
        reject_seq_k3=0.2,
        reject_geo_low=0.8,
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("seed", [0, 1])
def test_correction_matches_python_on_junk_padded_rows(name: str, seed: int) -> None:
    spec = SPECS[name]
    r = ragged(seed + 30, spread=0.5)
    train = r.t("train").requires_grad_()
    fix = rollout_correction(train, r.t("rollout"), r.mask_t, spec)
    weights, mask, metrics = reference(r, spec)
    if spec.rejects:  # the example must exercise the rule: some tokens out, some kept
        assert 0 < metrics["rejected_token_frac"] < 1, metrics
    torch.testing.assert_close(fix.mask, torch.tensor(mask, dtype=torch.float64))
    if weights is None:
        assert fix.weights is None
    else:
        assert fix.weights is not None and not fix.weights.requires_grad
        torch.testing.assert_close(fix.weights, torch.tensor(weights, dtype=torch.float64))
    assert fix.metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        assert fix.metrics[key].item() == pytest.approx(value, rel=1e-9), key


def test_sequence_weight_is_the_product_and_geometric_its_mean() -> None:
    train = torch.tensor([[LN(0.8), LN(0.3), 0.0]])
    rollout = torch.tensor([[LN(0.4), LN(0.2), 0.0]])  # token ratios 2 and 1.5
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    seq = rollout_correction(train, rollout, mask, RolloutCorrection("sequence", is_high=10.0))
    torch.testing.assert_close(seq.weights, torch.tensor([[3.0, 3.0, 0.0]]))
    geo = rollout_correction(train, rollout, mask, RolloutCorrection("geometric", is_high=10.0))
    torch.testing.assert_close(geo.weights, torch.tensor([[3**0.5, 3**0.5, 0.0]]))
    capped = rollout_correction(train, rollout, mask, RolloutCorrection("sequence", is_high=2.0))
    torch.testing.assert_close(capped.weights, torch.tensor([[2.0, 2.0, 0.0]]))


def test_the_former_tis_and_icepop_are_cases_of_it() -> None:
    r = ragged(40, spread=1.0)
    args = (r.t("train"), r.t("rollout"), r.mask_t)
    tis = rollout_correction(*args, RolloutCorrection("token", is_high=1.5))
    torch.testing.assert_close(tis.weights, tis_weights(*args, cap=1.5))
    torch.testing.assert_close(tis.mask, r.mask_t)
    icepop = RolloutCorrection(
        "token", is_mode="mask", is_low=1 / 1.5, is_high=1.5, on_reject="zero_weight"
    )
    got = rollout_correction(*args, icepop)
    torch.testing.assert_close(got.weights, masked_is_weights(*args, low=1 / 1.5, high=1.5))
    torch.testing.assert_close(got.mask, r.mask_t)  # zero weight, still counted


def test_drop_leaves_the_denominator_and_zero_weight_stays_in_it() -> None:
    # ratios 1, 4, 1; A = 1 everywhere, PPO ratio 1 -> token loss -w
    train = torch.tensor([[0.0, LN(0.8), 0.0]])
    rollout = torch.tensor([[0.0, LN(0.2), 0.0]])
    mask = torch.ones(1, 3)
    logp = torch.zeros(1, 3)
    rule = {"reject_token_high": 2.0}
    drop = rollout_correction(train, rollout, mask, RolloutCorrection(**rule))
    zero = rollout_correction(
        train, rollout, mask, RolloutCorrection(**rule, on_reject="zero_weight")
    )
    drop_loss, _ = ppo_loss(logp, logp, torch.ones(1, 3), drop.mask, is_weights=drop.weights)
    zero_loss, _ = ppo_loss(logp, logp, torch.ones(1, 3), zero.mask, is_weights=zero.weights)
    assert drop_loss.item() == pytest.approx(-1.0)  # (-1 - 1) / 2 kept tokens
    assert zero_loss.item() == pytest.approx(-2 / 3)  # (-1 + 0 - 1) / 3 counted tokens
    assert drop.metrics["rejected_token_frac"].item() == pytest.approx(1 / 3)
    assert drop.metrics["rejected_seq_frac"].item() == 0.0


def test_a_sequence_rule_rejects_whole_sequences() -> None:
    # row 0: mean k1 = -(ln 2 + 0)/2 < 0 (trainer likes it more): kept by k1 <= 0.1
    # row 1: mean k1 = ln 2 > 0.1: rejected whole
    train = torch.tensor([[LN(0.8), LN(0.5)], [LN(0.2), LN(0.2)]])
    rollout = torch.tensor([[LN(0.4), LN(0.5)], [LN(0.4), LN(0.4)]])
    fix = rollout_correction(train, rollout, torch.ones(2, 2), RolloutCorrection(reject_seq_k1=0.1))
    torch.testing.assert_close(fix.mask, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert fix.metrics["rejected_seq_frac"].item() == 0.5
    # the geometric-mean ratio of row 0 is sqrt(2) = 1.41: outside [0.5, 1.4]
    geo = RolloutCorrection(reject_geo_low=0.5, reject_geo_high=1.4)
    fix = rollout_correction(train, rollout, torch.ones(2, 2), geo)
    torch.testing.assert_close(fix.mask, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_spec_properties() -> None:
    assert not RolloutCorrection().active
    assert RolloutCorrection("token").active and not RolloutCorrection("token").needs_whole_batch
    assert RolloutCorrection(reject_seq_k3=1.0).needs_whole_batch
    assert not RolloutCorrection(reject_seq_k3=1.0, on_reject="zero_weight").needs_whole_batch
    assert RolloutCorrection("sequence", is_batch_normalize=True).needs_whole_batch
    assert RolloutCorrection("token", is_mode="mask").rejects
