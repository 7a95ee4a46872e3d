"""KL estimators k1/k2/k3 and veRL's abs/mse/low_var_kl: hand values, python references on
junk-padded batches, zero at equality, k3 >= 0 (property), clamps, loss and penalty."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algos import kl_divergence, kl_loss, kl_reward_penalty
from tests.algos.reference import aggregate, kl_token, per_row, ragged

LN = math.log


def test_estimators_hand_values() -> None:
    logp = torch.tensor([LN(0.5)])
    ref = torch.tensor([LN(0.25)])
    # log r = ln p_ref - ln p = ln 0.5 = -0.693147
    # k1 = -log r = 0.693147; k2 = (log r)^2 / 2 = 0.240227; k3 = (0.5 - 1) + 0.693147 = 0.193147
    assert kl_divergence(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_divergence(logp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_divergence(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    # clamp bounds each token's estimate
    assert kl_divergence(logp, ref, "k1", clamp=0.5).item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        kl_divergence(logp, ref, "k4")  # type: ignore[arg-type]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_zero_when_distributions_match(estimator: str) -> None:
    logp = -torch.rand(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kl_divergence(logp, logp.clone(), estimator), torch.zeros(3, 5))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-30, 0, allow_nan=False), min_size=1, max_size=16),
    st.lists(st.floats(-30, 0, allow_nan=False), min_size=1, max_size=16),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_k3_is_non_negative(a: list[float], b: list[float], dtype: torch.dtype) -> None:
    n = min(len(a), len(b))
    logp = torch.tensor(a[:n], dtype=dtype)
    ref = torch.tensor(b[:n], dtype=dtype)
    assert (kl_divergence(logp, ref, "k3") >= 0).all()
    assert (kl_divergence(logp, ref, "k2") >= 0).all()


def test_k1_and_k3_unbiased_on_average() -> None:
    # sampling from q, E[k1] = E[k3] = KL(q || p) for two categoricals
    q = torch.tensor([0.6, 0.3, 0.1])
    p = torch.tensor([0.2, 0.5, 0.3])
    exact = (q * (q / p).log()).sum()
    # exact expectation: weight each outcome's estimate by q instead of sampling
    for est in ("k1", "k3"):
        value = (q * kl_divergence(q.log(), p.log(), est)).sum()  # type: ignore[arg-type]
        torch.testing.assert_close(value, exact)


def test_kl_loss_masks_and_gradients() -> None:
    logp = torch.tensor([[LN(0.5), LN(0.5), 0.0]]).requires_grad_()
    ref = torch.tensor([[LN(0.25), LN(0.5), -math.inf]])  # padding may hold -inf
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # token mean of k3: (0.193147 + 0) / 2
    loss, m = kl_loss(logp, ref, mask, "k3")
    assert loss.item() == pytest.approx(0.193147 / 2, abs=1e-6)
    assert m["kl"].item() == pytest.approx(loss.item())
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 2].item() == 0.0
    # d k3 / d logp = 1 - p_ref/p = 1 - 0.5 = 0.5, divided by 2 tokens
    assert logp.grad[0, 0].item() == pytest.approx(0.25)


def test_kl_reward_penalty() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    logp = torch.tensor([[LN(0.5), LN(0.5), 0.0]], requires_grad=True)
    ref = torch.tensor([[LN(0.25), LN(1.0), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # k1 per token: ln 2, -ln 2, masked; coef 0.1 -> rewards [-0.0693147, 1.0693147, 0]
    out = kl_reward_penalty(rewards, logp, ref, mask, coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.0693147, 1.0693147, 0.0]]))
    assert not out.requires_grad  # a reward, not a loss


# --------------------------------------------------------------------------- veRL's names, clamps

ESTIMATORS = ["k1", "k2", "k3", "abs", "mse", "low_var_kl"]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("clamp", [None, 0.3])
def test_every_estimator_matches_python_on_counted_tokens(
    estimator: str, clamp: float | None
) -> None:
    r = ragged(10, spread=0.6)
    got = kl_divergence(r.t("train"), r.t("ref"), estimator, clamp)  # type: ignore[arg-type]
    expected = per_row(
        r, lambda i, t: kl_token(r.values["train"][i][t], r.values["ref"][i][t], estimator, clamp)
    )
    # kl_divergence is per position (junk in, junk out): compare the counted tokens
    counted = torch.where(r.mask_t > 0, got, torch.zeros_like(got))
    torch.testing.assert_close(counted, torch.tensor(expected, dtype=torch.float64))


def test_default_clamps_nothing_but_low_var_kl() -> None:
    logp = torch.tensor([0.0, 0.0])
    ref = torch.tensor([6.0, -30.0])  # log r = 6 and -30
    # k2 = 18 and 450: the old default clamp of 10 would have cut both
    torch.testing.assert_close(kl_divergence(logp, ref, "k2"), torch.tensor([18.0, 450.0]))
    torch.testing.assert_close(kl_divergence(logp, ref, "mse"), torch.tensor([18.0, 450.0]))
    torch.testing.assert_close(kl_divergence(logp, ref, "abs"), torch.tensor([6.0, 30.0]))
    k3 = kl_divergence(logp, ref, "k3")
    assert k3[0].item() == pytest.approx(math.exp(6) - 7, rel=1e-6)
    assert k3[1].item() == pytest.approx(29.0, rel=1e-6)
    # veRL's low_var_kl: k3 clamped to [-10, 10]
    torch.testing.assert_close(kl_divergence(logp, ref, "low_var_kl"), torch.tensor([10.0, 10.0]))
    # and kl_loss no longer clamps at 10 by default either
    loss, _ = kl_loss(logp.unsqueeze(0), ref.unsqueeze(0), torch.ones(1, 2), "k2")
    assert loss.item() == pytest.approx((18.0 + 450.0) / 2)
    loss, _ = kl_loss(logp.unsqueeze(0), ref.unsqueeze(0), torch.ones(1, 2), "k2", clamp=10.0)
    assert loss.item() == pytest.approx(10.0)


def test_low_var_kl_gradient_stays_finite_where_exp_overflows() -> None:
    logp = torch.tensor([[-200.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.2]])  # log r = 199: exp overflows float32 without the bound
    loss, _ = kl_loss(logp, ref, torch.ones(1, 2), "low_var_kl")
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0  # clamped token: no gradient
    # d/dlogp of k3 at log r = -0.2: 1 - e^-0.2, divided by 2 tokens
    assert logp.grad[0, 1].item() == pytest.approx((1 - math.exp(-0.2)) / 2, rel=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_kl_loss_aggregates_like_the_policy_loss_and_ignores_junk(estimator: str, agg: str) -> None:
    r = ragged(11)
    norm = 6.0 if agg == "seq-mean-token-sum-norm" else None
    logp = r.t("train").requires_grad_()
    loss, m = kl_loss(logp, r.t("ref"), r.mask_t, estimator, agg, norm_length=norm)  # type: ignore[arg-type]
    per_token = per_row(
        r, lambda i, t: kl_token(r.values["train"][i][t], r.values["ref"][i][t], estimator)
    )
    assert loss.item() == pytest.approx(aggregate(per_token, r.mask, agg, norm), rel=1e-9)
    assert m["kl"].item() == loss.item()
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[r.mask_t == 0] == 0).all()


def test_reward_penalty_takes_the_clamp_and_ignores_junk() -> None:
    r = ragged(12)
    rewards = torch.zeros_like(r.mask_t)
    out = kl_reward_penalty(rewards, r.t("train"), r.t("ref"), r.mask_t, 0.5, "k3", clamp=0.1)
    expected = per_row(
        r, lambda i, t: -0.5 * kl_token(r.values["train"][i][t], r.values["ref"][i][t], "k3", 0.1)
    )
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
