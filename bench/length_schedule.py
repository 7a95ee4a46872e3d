"""Length-aware scheduling (``[rollout] schedule``): "shortest_first" against "batch".

In one run, on one recipe whose response lengths spread widely — the digits task, scaled
(``bench._common.SCALES``), with 48-token answers and a policy whose end-of-sequence logit
depends strongly on the state (``tests.tiny.spread_lengths``: lengths from 1 to the cap, about
half of them at the cap), trained at a learning rate too small to move it — real
``relax.cluster.run`` clusters, rollout and trainer each in their own process, at
``--staleness`` (2 by default), a replica generating 8 prompts x 8 samples per round and the
trainer taking 32 rows per step (two steps per round):

- "batch": every group of a round reaches the bus when the round's longest response ends;
- "shortest_first": each group as its last sample ends (the shortest first), the round ordered
  by the lengths seen on earlier epochs.

Reported per schedule, medians over ``--rounds`` interleaved rounds: seconds per applied step
(from the ``--warmup``-th on), the mean lag of the trained rows (trainer version at the take
minus the row's version, from each step's ``lag_hist``), the mean response length, and the
trainer's wait for rows per step. The last lines are ``name = value``:
``shortest_first_vs_batch`` (steps/s ratio; > 1: faster) and both mean lags.

Run: ``python bench/length_schedule.py [--rounds 3] [--steps 30] [--staleness 2]
[--max-new-tokens 48]`` (about 4 minutes on 2 cores); an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (
    Run,
    limit_threads,
    load_average,
    median,
    phase_line,
    quiet,
    recipe,
    spread_model,
    timed_run,
)

SCHEDULES = ("batch", "shortest_first")


def spread_recipe(
    staleness: str,
    steps: int,
    schedule: str,
    model_dir: Path,
    max_new_tokens: int,
    extra: tuple[str, ...] = (),
) -> Any:
    """The wide-spread recipe on the model in ``model_dir``, ``extra`` overrides last."""
    cfg = recipe(
        staleness,
        steps,
        "scaled",
        extra=(
            f"rollout.max_new_tokens={max_new_tokens}",
            "rollout.batch_size=8",
            f'rollout.schedule="{schedule}"',
            "trainer.global_batch_size=32",
            "trainer.micro_batch_size=32",
            # The policy barely moves: the lengths keep their spread the whole run (trained
            # on the digits reward it soon answers in one token, and schedules stop mattering).
            "trainer.lr=1e-6",
            *extra,
        ),
    )
    model = cfg.model.model_copy(update={"path": str(model_dir), "init": None})
    return cfg.model_copy(update={"model": model})


def mean_lag(records: list[dict[str, Any]]) -> float:
    rows = lags = 0
    for record in records:
        for lag, count in (record.get("lag_hist") or {}).items():
            rows += int(count)
            lags += int(lag) * int(count)
    return lags / rows if rows else float("nan")


def summary(run: Run, warmup: int) -> dict[str, float]:
    measured = run.measured(warmup)
    return {
        "period_s": run.period(warmup),
        "lag": mean_lag(measured),
        "length": median([float(r.get("response_length_mean", "nan")) for r in measured]),
        "take_s": median([float(r.get("take_time_s", "nan")) for r in measured]),
        "resumed": median([float(r.get("resumed_token_share", 0.0)) for r in measured]),
        "token_lag": median([float(r.get("token_lag_mean", "nan")) for r in measured]),
    }


async def interleaved(
    args: argparse.Namespace, modes: dict[str, tuple[str, tuple[str, ...]]]
) -> tuple[dict[str, dict[str, float]], dict[str, list[Run]]]:
    """Run each mode (``name: (schedule, extra overrides)``) once per round on the wide-spread
    recipe, the order flipped every round; the medians of ``summary`` per mode, and the runs."""
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="relax-bench-lengths-") as tmp:
        model_dir = spread_model(Path(tmp))
        for round_ in range(args.rounds):
            order = list(modes) if round_ % 2 == 0 else list(modes)[::-1]
            for mode in order:
                schedule, extra = modes[mode]
                cfg = spread_recipe(
                    args.staleness, args.steps, schedule, model_dir, args.max_new_tokens, extra
                )
                run = await timed_run(cfg)
                runs[mode].append(run)
                results[mode].append(summary(run, args.warmup))
                r = results[mode][-1]
                print(
                    f"round {round_} {mode:>14}: {r['period_s'] * 1e3:7.1f} ms/step,"
                    f" lag {r['lag']:.2f}, token lag {r['token_lag']:.2f}, resumed tokens"
                    f" {r['resumed']:.1%}, length {r['length']:.1f}, take {r['take_s'] * 1e3:.1f} ms"
                )
    med = {m: {k: median([r[k] for r in results[m]]) for k in results[m][0]} for m in modes}
    for m in modes:
        print(
            f"{m:>14} (median): {med[m]['period_s'] * 1e3:.1f} ms/step, mean lag"
            f" {med[m]['lag']:.2f}, token lag {med[m]['token_lag']:.2f}, resumed tokens"
            f" {med[m]['resumed']:.1%}, length {med[m]['length']:.1f},"
            f" take {med[m]['take_s'] * 1e3:.1f} ms"
        )
        print(f"{m:>14}: {phase_line(runs[m], args.warmup)}")
    print(f"load average after: {load_average()}")
    print(f"staleness = {args.staleness}")
    print(f"max_new_tokens = {args.max_new_tokens}")
    return med, runs


def arguments(doc: str, staleness: str, max_new_tokens: int, steps: int) -> argparse.Namespace:
    """The benches' shared options (threads set and logging quietened)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--staleness", default=staleness)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    args = parser.parse_args()
    limit_threads(args.threads)
    quiet()
    print(f"load average before: {load_average()}")
    return args


async def main() -> None:
    args = arguments(__doc__, staleness="2", max_new_tokens=48, steps=30)
    med, _ = await interleaved(args, {s: (s, ()) for s in SCHEDULES})
    print(
        f"shortest_first_vs_batch = {med['batch']['period_s'] / med['shortest_first']['period_s']:.3f}"
    )
    print(f"lag_batch = {med['batch']['lag']:.3f}")
    print(f"lag_shortest_first = {med['shortest_first']['lag']:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
