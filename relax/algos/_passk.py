"""pass@k: the chance that at least one of k samples is correct, estimated without bias from
n ≥ k samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", eq. 1): ``1 - C(n - c, k) / C(n, k)``."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from ``n`` samples with ``c`` correct.

    Exact (integer binomials, one division): no product of ratios to round off. Raises
    ``ValueError`` unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """The mean pass@k over problems, each given as ``(n, c)``; NaN when there are none."""
    if not counts:
        return float("nan")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
