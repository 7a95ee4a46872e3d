"""Drawing one token per row, each row from its own seeded generator, as the HF engine does
for per-prompt seeds: all rows at once by inverse CDF (``relax.engines._hf._draw_per_row``)
against a ``torch.multinomial`` call per row (what it did before), in one run; and rows that
share one generator (unseeded, or one seed for the call): one uniform per row and the same
inverse CDF (``_inverse_cdf``) against one ``torch.multinomial`` for the batch.

Per vocabulary size (the 261 tokens of the digits models, 32k, 152k) and rows in a decode
batch (16, 64): the time of one decode step's draws, medians of interleaved repeats, one torch
thread as a rollout process runs. Also checked: the two agree on the distribution (the
frequencies of 20,000 draws of a small distribution, each within 0.015 of its probability).
The last lines are ``name = value``: ``seeded_draws_vs_multinomial_<vocab>_<rows>`` (time per
row ÷ time at once: > 1 is faster) and ``shared_draws_vs_multinomial_<vocab>_<rows>``.

Run: ``python bench/seeded_draws.py [--repeats 20]`` (about half a minute).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import limit_threads, load_average, median
from relax.engines._hf import _draw_per_row, _inverse_cdf

VOCABS = {"261": 261, "32k": 32_000, "152k": 151_936}
ROWS = (16, 64)


def per_row(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The baseline: ``torch.multinomial`` once per row, each with its generator."""
    return torch.cat(
        [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    )


def one_call(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The shared generator's baseline: one ``torch.multinomial`` for the whole batch."""
    return torch.multinomial(probs, 1, generator=generators[0]).squeeze(-1)


def shared(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The engine's shared-generator draw: a uniform per row, then the inverse CDF."""
    u = torch.rand(len(probs), dtype=torch.float64, generator=generators[0])
    return _inverse_cdf(probs, u)


def timed(draw, probs: torch.Tensor, generators: list[torch.Generator]) -> float:
    started = time.perf_counter()
    draw(probs, generators)
    return time.perf_counter() - started


def check_distribution() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    for draw in (per_row, _draw_per_row, one_call, shared):
        generators = [torch.Generator().manual_seed(0)]
        tokens = torch.cat([draw(probs, generators) for _ in range(20_000)])
        freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
        if not torch.allclose(freq, probs[0].double(), atol=0.015):
            raise SystemExit(f"{draw.__name__} drew the wrong distribution: {freq.tolist()}")


def main(repeats: int) -> None:
    limit_threads(1)
    print(f"load average before: {load_average()}")
    check_distribution()
    ratios = {}
    for name, vocab in VOCABS.items():
        for rows in ROWS:
            probs = torch.softmax(
                torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)), -1
            )
            generators = [torch.Generator().manual_seed(r) for r in range(rows)]
            draws = {"per_row": per_row, "at_once": _draw_per_row, "one_call": one_call}
            draws["shared"] = shared
            times: dict[str, list[float]] = {label: [] for label in draws}
            for repeat in range(repeats + 2):
                order = list(draws.items())
                for label, draw in order if repeat % 2 else order[::-1]:
                    took = timed(draw, probs, generators)
                    if repeat >= 2:  # two warm-up repeats
                        times[label].append(took)
            med = {label: median(values) for label, values in times.items()}
            ratios[f"seeded_draws_vs_multinomial_{name}_{rows}"] = med["per_row"] / med["at_once"]
            ratios[f"shared_draws_vs_multinomial_{name}_{rows}"] = med["one_call"] / med["shared"]
            print(
                f"vocabulary {name:>4}, {rows:2d} rows, ms per decode step: seeded per row"
                f" {med['per_row'] * 1e3:8.3f}, at once {med['at_once'] * 1e3:7.3f}; shared"
                f" generator, one multinomial {med['one_call'] * 1e3:8.3f},"
                f" inverse CDF {med['shared'] * 1e3:7.3f}"
            )
    print(f"load average after: {load_average()}")
    for key, ratio in ratios.items():
        print(f"{key} = {ratio:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    main(parser.parse_args().repeats)
