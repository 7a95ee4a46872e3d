"""Independent references for the algos tests: plain Python over lists, no torch expressions.

Batches are ragged and right-padded, and every position whose mask is 0 holds junk (large,
finite, random), so a function that lets padding leak disagrees with these loops.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

JUNK = (1e4, -1e4, 3e3, -7.5e3, 123.0, -987.0)


@dataclass
class Ragged:
    """One ragged batch as lists (``mask[i][t]`` 0/1) and as tensors."""

    mask: list[list[int]]
    values: dict[str, list[list[float]]]

    def t(self, name: str) -> torch.Tensor:
        return torch.tensor(self.values[name], dtype=torch.float64)

    @property
    def mask_t(self) -> torch.Tensor:
        return torch.tensor(self.mask, dtype=torch.float64)


def ragged(
    seed: int,
    lengths: tuple[int, ...] = (5, 1, 3, 0, 6, 2),
    width: int = 7,
    spread: float = 0.6,
) -> Ragged:
    """Rows of the given response lengths (one with a loss-masked hole), junk elsewhere.

    ``train`` and ``rollout`` are log-probs whose gap is up to ``spread`` per token; ``ref`` a
    reference's; ``adv`` per-token advantages; ``loss`` any per-token loss.
    """
    rng = random.Random(seed)
    mask = [[1 if t < n else 0 for t in range(width)] for n in lengths]
    if lengths[0] >= 3:
        mask[0][1] = 0  # a tool-output token inside the response
    values: dict[str, list[list[float]]] = {
        k: [] for k in ("train", "rollout", "ref", "adv", "loss")
    }
    for row in mask:
        rows = {k: [] for k in values}
        for m in row:
            if m:
                train = -rng.uniform(0.05, 4.0)
                rows["train"].append(train)
                rows["rollout"].append(train + rng.uniform(-spread, spread))
                rows["ref"].append(train + rng.uniform(-1.5, 1.5))
                rows["adv"].append(rng.uniform(-2.0, 2.0))
                rows["loss"].append(rng.uniform(-3.0, 3.0))
            else:
                for k in rows:
                    rows[k].append(rng.choice(JUNK))
        for k in values:
            values[k].append(rows[k])
    return Ragged(mask, values)


def counted(r: Ragged, name: str, i: int) -> list[float]:
    """Row ``i``'s values of ``name`` on its counted tokens."""
    return [v for v, m in zip(r.values[name][i], r.mask[i], strict=True) if m]


def aggregate(
    loss: list[list[float]], mask: list[list[int]], mode: str, norm_length: float | None = None
) -> float:
    """veRL's four loss aggregation modes, by hand."""
    rows = [
        [x for x, m in zip(lr, mr, strict=True) if m] for lr, mr in zip(loss, mask, strict=True)
    ]
    nonempty = [row for row in rows if row]
    if mode in ("token-mean", "token"):
        n = sum(len(row) for row in rows)
        return sum(sum(row) for row in rows) / n if n else 0.0
    if mode == "seq-mean-token-sum-norm":
        assert norm_length is not None
        return sum(sum(row) for row in rows) / (len(rows) * norm_length)
    if not nonempty:
        return 0.0
    if mode in ("seq-mean-token-mean", "sequence"):
        return sum(sum(row) / len(row) for row in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in nonempty) / len(nonempty)
    raise ValueError(mode)


def kl_token(logp: float, ref: float, estimator: str, clamp: float | None = None) -> float:
    """One token's KL estimate, ``log r = ref - logp``."""
    log_r = ref - logp
    if estimator == "k1":
        kl = -log_r
    elif estimator == "abs":
        kl = abs(log_r)
    elif estimator in ("k2", "mse"):
        kl = 0.5 * log_r * log_r
    elif estimator == "k3":
        kl = math.exp(log_r) - 1 - log_r
    elif estimator == "low_var_kl":
        x = min(max(log_r, -20.0), 20.0)
        kl = min(max(math.exp(x) - 1 - x, -10.0), 10.0)
    else:
        raise ValueError(estimator)
    return kl if clamp is None else min(max(kl, -clamp), clamp)


def ppo_token(
    logp: float,
    old: float,
    adv: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> float:
    """One token's PPO-clip loss ``-min(r A, clip(r) A)``, dual-clipped for ``A < 0``."""
    r = math.exp(logp - old)
    clipped = min(max(r, 1 - clip_low), 1 + clip_high)
    loss = max(-adv * r, -adv * clipped)
    if dual_clip is not None and adv < 0:
        loss = min(loss, -adv * dual_clip)
    return loss


def per_row(r: Ragged, fn) -> list[list[float]]:
    """``fn(i, t)`` on counted tokens, junk-free 0.0 elsewhere (the junk must not be read)."""
    return [[fn(i, t) if m else 0.0 for t, m in enumerate(row)] for i, row in enumerate(r.mask)]
