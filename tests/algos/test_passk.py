"""pass@k, the unbiased estimator of Chen et al. 2021, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from relax.algos import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        # 1 - C(n-c, k) / C(n, k), by hand:
        (4, 1, 1, 1 / 4),  # pass@1 is the fraction correct
        (10, 3, 1, 3 / 10),
        (4, 1, 2, 1 - 3 / 6),  # C(3,2)=3, C(4,2)=6
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
        (10, 2, 5, 1 - 56 / 252),  # C(8,5)=56, C(10,5)=252
        (4, 2, 3, 1.0),  # n - c = 2 < k = 3: every 3 drawn hold a correct one
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_edge_cases() -> None:
    for n in (1, 4, 16):
        assert pass_at_k(n, 0, 1) == 0.0  # c = 0: never
        assert pass_at_k(n, 0, n) == 0.0
        assert pass_at_k(n, n, 1) == 1.0  # c = n: always
        assert pass_at_k(n, n, n) == 1.0
    # n = k: pass@n is "any correct at all"
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0


def test_pass_at_k_rises_with_k_and_c() -> None:
    assert pass_at_k(8, 2, 1) < pass_at_k(8, 2, 2) < pass_at_k(8, 2, 4)
    assert pass_at_k(8, 1, 3) < pass_at_k(8, 2, 3) < pass_at_k(8, 3, 3)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)])
def test_bad_arguments_raise(n, c, k) -> None:
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_mean_over_problems() -> None:
    assert mean_pass_at_k([(4, 0), (4, 4)], 2) == 0.5
    assert mean_pass_at_k([(4, 1), (4, 2)], 1) == pytest.approx((0.25 + 0.5) / 2)
    assert math.isnan(mean_pass_at_k([], 1))
