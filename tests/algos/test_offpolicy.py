"""Off-policy corrections: TIS, masked IS (IcePop), AReaL's decoupled PPO."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algos import decoupled_ppo_loss, masked_is_weights, ppo_loss, tis_weights

LN = math.log
# trainer log-probs vs engine log-probs: ratios 0.9/0.3 = 3, 0.6/0.6 = 1, 0.1/0.2 = 0.5
OLD = torch.tensor([[LN(0.9), LN(0.6), LN(0.1)]])
ROLLOUT = torch.tensor([[LN(0.3), LN(0.6), LN(0.2)]])


def test_tis_hand_example() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # min(ratio, 2) = [2, 1, 0.5], masked -> [2, 1, 0]
    torch.testing.assert_close(
        tis_weights(OLD, ROLLOUT, mask, cap=2.0), torch.tensor([[2.0, 1.0, 0.0]])
    )


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(-20, 0), min_size=4, max_size=4),
    st.lists(st.floats(-20, 0), min_size=4, max_size=4),
    st.floats(1.0, 10.0),
)
def test_tis_cap_respected(old: list[float], rollout: list[float], cap: float) -> None:
    w = tis_weights(torch.tensor([old]), torch.tensor([rollout]), torch.ones(1, 4), cap=cap)
    assert (w <= cap).all() and (w >= 0).all()


def test_masked_is_hand_example() -> None:
    mask = torch.ones(1, 3)
    # ratios [3, 1, 0.5] in [0.5, 2]: 3 is outside -> 0; bounds are inclusive
    w = masked_is_weights(OLD, ROLLOUT, mask, low=0.5, high=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.5]]))


def test_weights_carry_no_gradient() -> None:
    old = OLD.clone().requires_grad_()
    assert not tis_weights(old, ROLLOUT, torch.ones(1, 3)).requires_grad
    assert not masked_is_weights(old, ROLLOUT, torch.ones(1, 3)).requires_grad


def test_ppo_with_is_weights() -> None:
    # ratio 1 -> per-token loss -A; weights [2, 1, 0] (TIS above) scale it: -(2*1 + 1*3) / 2
    logp = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = tis_weights(OLD, ROLLOUT, mask, cap=2.0)
    loss, _ = ppo_loss(logp, logp, torch.tensor([[1.0, 3.0, 7.0]]), mask, is_weights=w)
    assert loss.item() == pytest.approx(-2.5)


def test_decoupled_ppo_hand_example() -> None:
    logp = torch.tensor([[LN(1.5)]], requires_grad=True)
    prox = torch.zeros(1, 1)
    behav = torch.tensor([[LN(0.5)]])
    mask = torch.ones(1, 1)
    # r = pi / pi_prox = 1.5 -> clipped surrogate -1.2 (A = 1);
    # behaviour weight pi_prox / pi_behav = 1 / 0.5 = 2 -> loss -2.4
    loss, m = decoupled_ppo_loss(logp, prox, behav, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-2.4, abs=1e-6)
    assert m["behavior_weight_mean"].item() == pytest.approx(2.0)
    assert m["clip_frac"].item() == 1.0
    # a cap of 1.5 drops the token (AReaL masks, not truncates) -> loss 0
    loss, m = decoupled_ppo_loss(
        logp, prox, behav, torch.tensor([1.0]), mask, behavior_weight_cap=1.5
    )
    assert loss.item() == 0.0
    assert m["behavior_capped_frac"].item() == 1.0


def test_decoupled_ppo_reduces_to_ppo_when_behaviour_is_proximal() -> None:
    gen = torch.Generator().manual_seed(0)
    prox = -torch.rand(3, 4, generator=gen)
    logp = (prox + 0.3 * torch.randn(3, 4, generator=gen)).requires_grad_()
    adv = torch.randn(3, 4, generator=gen)
    mask = (torch.rand(3, 4, generator=gen) > 0.2).float()
    d_loss, _ = decoupled_ppo_loss(logp, prox, prox.clone(), adv, mask, 0.2, 0.28)
    p_loss, _ = ppo_loss(logp, prox, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(d_loss, p_loss)


def test_decoupled_ppo_gradients() -> None:
    gen = torch.Generator().manual_seed(1)
    logp = (-torch.rand(2, 3, generator=gen)).requires_grad_()
    prox = (logp.detach() + 0.05 * torch.randn(2, 3, generator=gen)).requires_grad_()
    behav = logp.detach() + 0.5 * torch.randn(2, 3, generator=gen)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = decoupled_ppo_loss(logp, prox, behav, torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 2].item() == 0.0
    assert prox.grad is None  # proximal log-probs are a fixed anchor
