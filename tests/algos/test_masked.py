"""Masked reductions and loss aggregation against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from relax.algos import (
    AGGREGATION_ALIASES,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from tests.algos.reference import aggregate, ragged

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


# --------------------------------------------------------------------------- veRL's four modes

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", [*MODES, "token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_aggregation_matches_a_python_loop_on_junk_padded_rows(mode: str, seed: int) -> None:
    r = ragged(seed)
    norm = 5.0 if mode == "seq-mean-token-sum-norm" else None
    got = aggregate_loss(r.t("loss"), r.mask_t, mode, norm)  # type: ignore[arg-type]
    assert got.item() == pytest.approx(aggregate(r.values["loss"], r.mask, mode, norm), rel=1e-12)


def test_first_names_are_the_same_reductions() -> None:
    r = ragged(3)
    for alias, name in AGGREGATION_ALIASES.items():
        a = aggregate_loss(r.t("loss"), r.mask_t, alias)  # type: ignore[arg-type]
        assert torch.equal(a, aggregate_loss(r.t("loss"), r.mask_t, name))  # type: ignore[arg-type]


def test_norm_mode_weighs_every_token_the_same_whatever_the_mask() -> None:
    # Dr. GRPO: d loss / d l_it = 1 / (rows * L) on every counted token, whatever the lengths
    # and however many tokens are masked (a count-based divisor would change it).
    r = ragged(4)
    for mask in (r.mask_t, r.mask_t * torch.tensor([0.0, 1, 1, 1, 0, 1, 1])):
        loss = r.t("loss").requires_grad_()
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=8.0).backward()
        expected = mask * (1 / (len(r.mask) * 8.0))
        torch.testing.assert_close(loss.grad, expected)


def test_norm_mode_needs_a_positive_length() -> None:
    r = ragged(5)
    for bad in (None, 0.0):
        with pytest.raises(ValueError, match="norm_length"):
            aggregate_loss(r.t("loss"), r.mask_t, "seq-mean-token-sum-norm", bad)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_of_an_empty_mask_is_zero(mode: str) -> None:
    r = ragged(6)
    got = aggregate_loss(r.t("loss"), torch.zeros_like(r.mask_t), mode, 4.0)  # type: ignore[arg-type]
    assert got.item() == 0.0
