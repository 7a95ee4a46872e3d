"""Masked reductions and loss aggregation against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from relax.algos import aggregate_loss, masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum_and_mean() -> None:
    # counted: 1, 2, 4 -> sum 7, mean 7/3; per row: (1+2)/2 = 1.5 and 4/1 = 4
    assert masked_sum(X, MASK).item() == pytest.approx(7.0)
    assert masked_mean(X, MASK).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 4.0]))


def test_empty_mask_gives_zero_not_nan() -> None:
    empty = torch.zeros_like(MASK)
    assert masked_mean(X, empty).item() == 0.0
    assert masked_var(X, empty).item() == 0.0
    assert torch.equal(masked_whiten(X, empty), torch.zeros_like(X))


def test_masked_var_and_whiten() -> None:
    # counted 1, 2, 4: mean 7/3, deviations -4/3, -1/3, 5/3, squares sum 42/9,
    # unbiased var = (42/9)/2 = 7/3, std = 1.527525
    assert masked_var(X, MASK).item() == pytest.approx(7 / 3)
    expected = torch.tensor([[-0.872872, -0.218218, 0.0], [1.091089, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(X, MASK), expected, atol=1e-5, rtol=0)
    # shift_mean=False only rescales: add the mean 7/3 back on counted tokens
    torch.testing.assert_close(
        masked_whiten(X, MASK, shift_mean=False), (expected + 7 / 3) * MASK, atol=1e-5, rtol=0
    )


def test_aggregate_loss_modes() -> None:
    loss = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # token: (1 + 2 + 4) / 3 tokens
    assert aggregate_loss(loss, mask, "token").item() == pytest.approx(7 / 3)
    # sequence: mean(1.5, 4) -- the empty third row is left out
    assert aggregate_loss(loss, mask, "sequence").item() == pytest.approx(2.75)
    # seq-mean-token-sum: mean(3, 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "nope")  # type: ignore[arg-type]
