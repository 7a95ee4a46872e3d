"""KL estimators k1/k2/k3: hand values, zero at equality, k3 >= 0 (property), loss and penalty."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algos import kl_divergence, kl_loss, kl_reward_penalty

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
