"""Policy losses (PPO, GSPO, CISPO) and entropy: hand examples, identities, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algos import (
    cispo_loss,
    entropy_bonus,
    entropy_from_logits,
    gspo_loss,
    logprobs_from_logits,
    masked_mean,
    ppo_loss,
)
from tests.algos.reference import aggregate, counted, per_row, ppo_token, ragged

LN = math.log


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)])


def test_ppo_hand_example_symmetric_clip() -> None:
    old = torch.zeros(1, 3)
    logp = _row(LN(1.5), LN(0.5), 0.0)
    adv = _row(1.0, -1.0, 5.0)
    mask = _row(1.0, 1.0, 0.0)
    # tok0: r=1.5, A=1: max(-1.5, -1.2) = -1.2 (clipped)
    # tok1: r=0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped); tok2 masked
    # token mean: (-1.2 + 0.8) / 2 = -0.2
    loss, m = ppo_loss(logp, old, adv, mask, clip_low=0.2)
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(1.0)
    # ratio stats over counted tokens only: mean (1.5 + 0.5) / 2 = 1, max 1.5
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    # approx KL (k3 of old||new): ((0.5 - ln 1.5) + (-0.5 - ln 0.5)) / 2 = 0.0439892
    assert m["approx_kl"].item() == pytest.approx(((0.5 - LN(1.5)) + (-0.5 - LN(0.5))) / 2)


def test_ppo_clip_higher_is_asymmetric() -> None:
    old = torch.zeros(1, 2)
    logp = _row(LN(1.5), LN(0.5))
    adv = _row(1.0, -1.0)
    mask = torch.ones(1, 2)
    # clip_high 0.6: tok0 r=1.5 < 1.6 is no longer clipped -> -1.5; tok1 still 0.8
    # loss (-1.5 + 0.8) / 2 = -0.35, one of two tokens clipped
    loss, m = ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)
    assert loss.item() == pytest.approx(-0.35, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_ppo_dual_clip_bounds_negative_advantage_loss() -> None:
    old = torch.zeros(1, 2)
    logp = _row(LN(5.0), LN(5.0))
    adv = _row(-1.0, 1.0)
    mask = torch.ones(1, 2)
    # tok0: A=-1, r=5: max(5, 1.2) = 5, dual clip c=3: min(5, 3) = 3
    # tok1: A=+1, r=5: max(-5, -1.2) = -1.2 (dual clip never applies to A > 0)
    # loss (3 - 1.2) / 2 = 0.9
    loss, m = ppo_loss(logp, old, adv, mask, clip_low=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(0.9, abs=1e-6)
    assert m["dual_clip_frac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        ppo_loss(logp, old, adv, mask, dual_clip=1.0)


def test_ppo_aggregation_modes() -> None:
    old = torch.zeros(2, 3)
    logp = torch.zeros(2, 3)  # ratio 1 -> per-token loss = -A
    adv = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # token: -(1+2+4)/3; sequence: -mean(1.5, 4); seq-mean-token-sum: -mean(3, 4)
    assert ppo_loss(logp, old, adv, mask, agg="token")[0].item() == pytest.approx(-7 / 3)
    assert ppo_loss(logp, old, adv, mask, agg="sequence")[0].item() == pytest.approx(-2.75)
    loss = ppo_loss(logp, old, adv, mask, agg="seq-mean-token-sum")[0]
    assert loss.item() == pytest.approx(-3.5)


def test_ppo_ratio_one_equals_minus_mean_advantage() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=gen)
    adv = torch.randn(4, 5, generator=gen)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    loss, m = ppo_loss(logp, logp.clone(), adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-masked_mean(adv, mask).item(), abs=1e-6)
    assert m["clip_frac"].item() == 0.0
    assert m["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    # per-sequence advantages broadcast over tokens
    seq_adv = torch.randn(4, generator=gen)
    loss, _ = ppo_loss(logp, logp.clone(), seq_adv, mask)
    expected = -masked_mean(seq_adv[:, None].expand(4, 5), mask)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


def test_ppo_clip_fraction_counts_tokens() -> None:
    old = torch.zeros(1, 5)
    # ratios 1.0, 1.1, 1.3, 0.7, 0.9 with A > 0: only 1.3 is clipped (0.7 < 0.8 is not,
    # since with A > 0 the unclipped branch is already the pessimistic one)
    logp = torch.log(_row(1.0, 1.1, 1.3, 0.7, 0.9))
    _, m = ppo_loss(logp, old, torch.ones(1, 5), torch.ones(1, 5), clip_low=0.2)
    assert m["clip_frac"].item() == pytest.approx(1 / 5)
    # with A < 0 the low side clips instead: only 0.7
    _, m = ppo_loss(logp, old, -torch.ones(1, 5), torch.ones(1, 5), clip_low=0.2)
    assert m["clip_frac"].item() == pytest.approx(1 / 5)


@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo"])
def test_gradients_are_finite_and_zero_on_masked_positions(loss_name: str) -> None:
    gen = torch.Generator().manual_seed(2)
    logp = (-torch.rand(3, 4, generator=gen)).requires_grad_()
    # near-on-policy so that even GSPO's narrow default clip leaves gradients to check
    old = logp.detach() + 1e-4 * torch.randn(3, 4, generator=gen)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    old = torch.where(mask > 0, old, torch.full_like(old, -math.inf))  # padding as -inf
    adv = torch.tensor([1.0, -0.5, 2.0])
    fn = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}[loss_name]
    loss, metrics = fn(logp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in metrics.values())
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert (logp.grad[mask > 0] != 0).any()


def test_gspo_hand_example() -> None:
    old = torch.zeros(2, 2)
    logp = torch.tensor([[LN(2.0), LN(0.5)], [0.1, 0.3]])
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, 1.0])
    # seq 0: mean log-ratio (ln 2 + ln 0.5)/2 = 0 -> s = 1 -> loss -1 (token ratios 2 and 0.5
    #        would have been clipped by PPO; GSPO does not look at them)
    # seq 1: mean log-ratio 0.2 -> s = e^0.2 = 1.2214 > 1.2 -> clipped -> loss -1.2
    # mean over sequences: (-1 - 1.2) / 2 = -1.1
    loss, m = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["seq_ratio_mean"].item() == pytest.approx((1 + math.exp(0.2)) / 2, abs=1e-6)


def test_gspo_equals_ppo_for_one_token_sequences() -> None:
    gen = torch.Generator().manual_seed(3)
    logp = (0.3 * torch.randn(8, 1, generator=gen)).requires_grad_()
    old = torch.zeros(8, 1)
    adv = torch.randn(8, generator=gen)
    mask = torch.ones(8, 1)
    g_loss, _ = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    (g_grad,) = torch.autograd.grad(g_loss, logp)
    p_loss, _ = ppo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    (p_grad,) = torch.autograd.grad(p_loss, logp)
    torch.testing.assert_close(g_loss, p_loss)
    torch.testing.assert_close(g_grad, p_grad)


def test_gspo_equals_sequence_ppo_when_token_ratios_are_equal() -> None:
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(5, 4, generator=gen)
    shift = 0.3 * torch.randn(5, 1, generator=gen)  # one log-ratio per sequence
    logp = (old + shift).requires_grad_()
    adv = torch.randn(5, generator=gen)
    mask = torch.ones(5, 4)
    mask[0, 2:] = 0
    g_loss, _ = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    p_loss, _ = ppo_loss(logp, old, adv, mask, clip_low=0.2, agg="sequence")
    torch.testing.assert_close(g_loss, p_loss)
    g_grad, p_grad = torch.autograd.grad(g_loss, logp)[0], torch.autograd.grad(p_loss, logp)[0]
    torch.testing.assert_close(g_grad, p_grad)


def test_cispo_hand_example_and_gradient() -> None:
    old = torch.zeros(1, 2)
    logp = _row(LN(2.0), LN(0.5)).requires_grad_()
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])
    # weights sg(clip(r, max=1.28)): r=2 -> 1.28, r=0.5 -> 0.5 (no lower bound)
    # loss -(1.28 * ln 2 + 0.5 * ln 0.5) / 2 = -(0.887228 - 0.346574) / 2 = -0.270327
    loss, m = cispo_loss(logp, old, adv, mask, clip_high=0.28)
    assert loss.item() == pytest.approx(-0.270327, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # d/dlogp = -w * A / 2: the clipped token still gets a gradient (unlike PPO)
    torch.testing.assert_close(logp.grad, _row(-0.64, -0.25))
    # a lower bound of 0.2 lifts the 0.5 weight to 0.8
    loss_lb, _ = cispo_loss(logp, old, adv, mask, clip_high=0.28, clip_low=0.2)
    assert loss_lb.item() == pytest.approx(-(1.28 * LN(2) + 0.8 * LN(0.5)) / 2, abs=1e-6)


def test_entropy_and_logprobs_from_logits() -> None:
    uniform = torch.zeros(1, 1, 4)
    # uniform over 4 tokens: H = ln 4 = 1.386294
    assert entropy_from_logits(uniform).item() == pytest.approx(LN(4))
    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(2, 3, 7, generator=gen)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    # logits (0, 0, ln 2) -> probs (0.25, 0.25, 0.5); token 2 has log-prob ln 0.5
    lp = logprobs_from_logits(torch.tensor([[[0.0, 0.0, LN(2)]]]), torch.tensor([[2]]))
    assert lp.item() == pytest.approx(LN(0.5))
    # a near-one-hot distribution stays finite
    peaked = torch.tensor([[[0.0, -1e4, -1e4]]])
    assert torch.isfinite(entropy_from_logits(peaked)).all()


def test_entropy_bonus() -> None:
    logits = torch.zeros(1, 2, 4).requires_grad_()
    mask = torch.tensor([[1.0, 0.0]])
    # -coef * ln 4 = -0.1 * 1.386294
    loss, m = entropy_bonus(logits, mask, coef=0.1)
    assert loss.item() == pytest.approx(-0.1 * LN(4))
    assert m["entropy"].item() == pytest.approx(LN(4))
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[0, 1], torch.zeros(4))


# --------------------------------------------------------------------------- python references


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_loss_matches_python_on_junk_padded_rows(agg: str, dual_clip: float | None) -> None:
    r = ragged(20, spread=0.8)  # ratios up to e^0.8: some clipped, some dual-clipped
    norm = 7.0 if agg == "seq-mean-token-sum-norm" else None
    logp = r.t("rollout").requires_grad_()  # "rollout" plays the new policy here
    loss, m = ppo_loss(
        logp, r.t("train"), r.t("adv"), r.mask_t, 0.2, 0.28, dual_clip, agg, norm_length=norm
    )  # type: ignore[arg-type]
    v = r.values
    per_token = per_row(
        r,
        lambda i, t: ppo_token(
            v["rollout"][i][t], v["train"][i][t], v["adv"][i][t], 0.2, 0.28, dual_clip
        ),
    )
    assert loss.item() == pytest.approx(aggregate(per_token, r.mask, agg, norm), rel=1e-9)
    # ppo_kl (veRL): mean over counted tokens of old - new; approx_kl: mean of k3
    gaps = [
        o - n
        for i in range(len(r.mask))
        for o, n in zip(counted(r, "train", i), counted(r, "rollout", i), strict=True)
    ]
    assert m["ppo_kl"].item() == pytest.approx(sum(gaps) / len(gaps), rel=1e-9)
    k3 = [math.exp(-g) - 1 + g for g in gaps]
    assert m["approx_kl"].item() == pytest.approx(sum(k3) / len(k3), rel=1e-9)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[r.mask_t == 0] == 0).all()


def test_ppo_kl_is_k1_of_old_minus_new() -> None:
    old = _row(LN(0.5), LN(0.25), 0.0)
    logp = _row(LN(0.25), LN(0.5), 5.0)
    # old - new: ln 2 and -ln 2 -> mean 0 (k1 can cancel); k3 does not: both terms positive
    _, m = ppo_loss(logp, old, torch.ones(1, 3), _row(1.0, 1.0, 0.0))
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert m["approx_kl"].item() == pytest.approx(((0.5 - 1 + LN(2)) + (2 - 1 - LN(2))) / 2)


def test_gspo_reports_token_and_sequence_clip_fractions() -> None:
    old = torch.zeros(3, 3)
    # seq 0: 3 tokens, mean log-ratio 0.3 -> clipped; seq 1: 1 token at 0 -> not clipped;
    # seq 2: 2 tokens, mean log-ratio -0.3, A < 0 -> clipped (the low side)
    logp = torch.tensor([[0.3, 0.3, 0.3], [0.0, 9.0, 9.0], [-0.3, -0.3, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    _, m = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert m["clip_frac_seq"].item() == pytest.approx(2 / 3)  # 2 of 3 sequences
    assert m["clip_frac"].item() == m["clip_frac_seq"].item()
    assert m["clip_frac_token"].item() == pytest.approx(5 / 6)  # 3 + 2 of 6 tokens


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_cispo_and_entropy_take_every_aggregation(agg: str) -> None:
    r = ragged(21)
    norm = 4.0 if agg == "seq-mean-token-sum-norm" else None
    loss, _ = cispo_loss(
        r.t("rollout"), r.t("train"), r.t("adv"), r.mask_t, agg=agg, norm_length=norm
    )  # type: ignore[arg-type]
    v = r.values

    def token(i: int, t: int) -> float:
        w = min(math.exp(v["rollout"][i][t] - v["train"][i][t]), 1.28)
        return -w * v["adv"][i][t] * v["rollout"][i][t]

    assert loss.item() == pytest.approx(aggregate(per_row(r, token), r.mask, agg, norm), rel=1e-9)
    logits = torch.zeros(len(r.mask), len(r.mask[0]), 4, dtype=torch.float64)
    bonus, m = entropy_bonus(logits, r.mask_t, 0.1, agg, norm)  # type: ignore[arg-type]
    expected = aggregate(per_row(r, lambda i, t: LN(4)), r.mask, agg, norm)
    assert m["entropy"].item() == pytest.approx(expected)
    assert bonus.item() == pytest.approx(-0.1 * expected)
