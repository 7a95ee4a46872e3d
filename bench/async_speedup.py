"""How much faster asynchronous training runs than on-policy training, against the overlap limit.

In one run, on one recipe, with the same CPU threads throughout:

- steps/s of real ``relax.cluster.run`` clusters at staleness 0, 1, 2 and "inf", rollout and
  trainer each in their own process with ``--threads`` torch threads (1 by default: one core
  each on a 2-core machine). Timed from the ``--warmup``-th applied step to the last, from the
  moments the trainer's ``metrics.jsonl`` lines appear: start-up and shut-down are left out.
- T_gen and T_train of one step's work, done alone in this process with the classes the roles
  use (the engine of ``relax.engines.open_engine`` generating one step's samples; a
  ``relax.training.TorchBackend`` step on them), same sizes and threads.

On-policy training alternates the two, so at best it takes T_gen + T_train per step; perfect
overlap takes max(T_gen, T_train). The limit of any asynchronous speed-up is therefore
``(T_gen + T_train) / max(T_gen, T_train)``, and ``async_vs_limit`` is the measured speed-up of
staleness "inf" over staleness 0 divided by that limit (1.0 = all the overlap there is; it
can exceed 1 when staleness 0 also pays fixed per-step costs on its critical path - scoring,
the weight hand-off - that the asynchronous modes hide as well).

Every configuration is repeated ``--rounds`` times, interleaved (the order rotates each round:
the machine's noise is shared), and medians are compared. The recipe is
``examples/digits/cluster.toml`` "scaled" (a wider model, 32-token answers: generation and
training of comparable cost, each far above the fixed per-step costs) or, with
``--scale digits``, exactly as shipped (tens of ms per step: the fixed costs dominate).

The last lines are machine-readable, one ``name = value`` each. Run:
``python bench/async_speedup.py [--rounds 3] [--steps 30] [--scale scaled|digits|100m]``
(``100m``: a ~100 M-parameter model with 128-token answers, compute-bound; for a GPU machine)
(about 5-6 minutes on 2 cores with the defaults; start-up is 9-30 s per run of 34 steps).
The machine must be otherwise idle: overlap needs the second core, so any outside load makes
the asynchronous modes look worse than they are (the bench warns when the load average is
above 1, and prints each process's CPU per step and the share of the machine the cluster got).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (
    SCALES,
    Run,
    StepCosts,
    limit_threads,
    load_average,
    median,
    phase_line,
    quiet,
    recipe,
    timed_run,
)

MODES = ("0", "1", "2", "inf")
# The processes of a cluster run, in start order (see bench._common.cpu_snapshot).
PROCESSES = (
    "main: supervisor, dataset, reward",
    "prompts bus",
    "samples bus",
    "trainer",
    "rollout",
)


def _times(run: Run) -> list[float]:
    return [t for t, _ in run.applied()]


def describe(runs: list[Run], warmup: int) -> dict[str, Any]:
    """Medians over the runs of one mode: the period and where it goes."""

    def per_run(fn: Any) -> float:
        return median([fn(r) for r in runs])

    def steps(r: Run) -> list[dict[str, Any]]:
        return r.measured(warmup)

    def mean_of(r: Run, fn: Any) -> float:
        return statistics.fmean([fn(s) for s in steps(r)])

    periods = [r.period(warmup) for r in runs]
    cpu_per_run = [r.cpu_per_step(warmup) for r in runs]
    return {
        "period": median(periods),
        "spread": (max(periods) - min(periods)) / median(periods),
        # The longest gap between two timed steps in any run (a stall shows up here).
        "worst": max(max(b - a for a, b in itertools.pairwise(_times(r)[warmup:])) for r in runs),
        # Inside the trainer: the optimiser step; the wait for a batch (a mean: with staleness
        # 1 or 2 a trainer can wait on every other step only); the rest of the period is
        # publishing the weights (acking the batch with them) and the loop around it.
        "train": per_run(lambda r: median([s["step_time_s"] for s in steps(r)])),
        "wait": per_run(lambda r: mean_of(r, lambda s: s["wall_s"] - s["step_time_s"])),
        "publish": per_run(lambda r: r.period(warmup) - mean_of(r, lambda s: s["wall_s"])),
        # How many versions behind the trainer the oldest row of a batch was.
        "lag": per_run(
            lambda r: median([s["step"] - 1 - s["oldest_row_version"] for s in steps(r)])
        ),
        "tokens": per_run(lambda r: median([s["tokens"] / s["rows"] for s in steps(r)])),
        "startup": per_run(lambda r: r.applied()[0][0] - r.started),
        # CPU seconds per step of each process (median over the runs, position by position),
        # and the share of the machine the whole cluster got.
        "cpu": [median(list(col)) for col in zip(*cpu_per_run, strict=False)],
        "share": median(
            [
                sum(c) / ((os.cpu_count() or 1) * p)
                for c, p in zip(cpu_per_run, periods, strict=True)
                if c
            ]
        ),
    }


async def main(args: argparse.Namespace) -> None:
    quiet()
    total_steps = args.warmup + args.steps + 1
    costs = StepCosts(recipe("0", total_steps, args.scale))
    runs: dict[str, list[Run]] = {m: [] for m in args.modes}
    clock = time.monotonic()
    print(f"load average before: {load_average()}", flush=True)
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if busy > 1.0:
        print(
            f"warning: the machine is already busy (load {busy:.1f} on {os.cpu_count()} cores):"
            " overlap needs idle cores, so the asynchronous figures will come out low",
            flush=True,
        )
    for r in range(args.rounds):
        await costs.measure(args.cost_reps)
        order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]
        for mode in order:
            run = await timed_run(recipe(mode, total_steps, args.scale))
            runs[mode].append(run)
            print(
                f"round {r + 1}/{args.rounds} staleness {mode:>3}: "
                f"{1 / run.period(args.warmup):5.2f} steps/s "
                f"(start-up {run.applied()[0][0] - run.started:4.1f} s)",
                flush=True,
            )
    t_gen, t_train = median(costs.gen_s), median(costs.train_s)
    limit = (t_gen + t_train) / max(t_gen, t_train)
    stats = {m: describe(runs[m], args.warmup) for m in args.modes}
    base = stats["0"]["period"]
    print(f"load average after: {load_average()}; bench took {time.monotonic() - clock:.0f} s")
    print(
        f"\nrecipe digits/{args.scale}, {args.threads} torch thread(s) per process; "
        f"median of {args.rounds} runs per mode, {args.steps} timed steps each"
    )
    print(
        f"one step alone (median of {len(costs.gen_s)}): T_gen {t_gen * 1e3:6.1f} ms, "
        f"T_train {t_train * 1e3:6.1f} ms ({median(costs.response_tokens):.1f} tokens/answer)"
        f" -> on-policy floor {(t_gen + t_train) * 1e3:6.1f} ms/step, "
        f"overlap floor {max(t_gen, t_train) * 1e3:6.1f} ms/step, limit {limit:.2f}x"
    )
    print(
        "staleness  steps/s  ms/step  spread  speedup | trainer ms/step: step  waits  publish+"
        " | lag  tokens/answer  worst gap  start-up"
    )
    for m in args.modes:
        s = stats[m]
        print(
            f"{m:>9}  {1 / s['period']:7.2f}  {s['period'] * 1e3:7.1f}  {s['spread']:5.0%}  "
            f"{base / s['period']:6.2f}x | {s['train'] * 1e3:20.1f}  {s['wait'] * 1e3:5.1f}"
            f"  {s['publish'] * 1e3:8.1f} | {s['lag']:3.0f}  {s['tokens']:13.1f}  "
            f"{s['worst'] * 1e3:6.0f} ms  "
            f"{s['startup']:6.1f} s"
        )
    for m in args.modes:  # the trainer's own phases (take, gradient, update, publish)
        print(f"staleness {m:>3}: {phase_line(runs[m], args.warmup)}")
    s0, inf = stats["0"], stats.get("inf")
    print(
        f"per-step cost beyond the compute: staleness 0 "
        f"{(s0['period'] - t_gen - t_train) * 1e3:+.1f} ms vs T_gen + T_train"
        + (
            f"; inf {(inf['period'] - max(t_gen, t_train)) * 1e3:+.1f} ms vs max(T_gen, T_train)"
            if inf
            else ""
        )
    )
    print(
        "CPU ms per step by process (the machine has "
        f"{os.cpu_count()} cores = {os.cpu_count() or 0} x ms/step of CPU per step):"
    )
    print(
        f"{'staleness':>9}  " + "  ".join(f"{p:>{max(9, len(p))}}" for p in PROCESSES) + "  total"
    )
    for m in args.modes:
        cpu = stats[m]["cpu"]
        if len(cpu) == len(PROCESSES):
            cells = "  ".join(
                f"{c * 1e3:>{max(9, len(p))}.1f}" for c, p in zip(cpu, PROCESSES, strict=True)
            )
            print(f"{m:>9}  {cells}  {sum(cpu) * 1e3:5.1f}  {stats[m]['share']:6.0%}")
    for m in args.modes:
        if m != "0":
            print(f"speedup_s{m} = {base / stats[m]['period']:.3f}")
    print(f"t_gen_ms = {t_gen * 1e3:.1f}")
    print(f"t_train_ms = {t_train * 1e3:.1f}")
    print(f"overlap_limit = {limit:.3f}")
    if inf is not None:
        print(f"async_vs_limit = {base / inf['period'] / limit:.3f}")
    else:
        print(f"async_vs_limit = {math.nan}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="applied steps before the clock")
    parser.add_argument("--scale", choices=tuple(SCALES), default="scaled")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--cost-reps", type=int, default=5, help="T_gen/T_train reps per round")
    parser.add_argument(
        "--modes", type=lambda s: tuple(s.split(",")), default=MODES, help="e.g. 0,inf"
    )
    args = parser.parse_args()
    if "0" not in args.modes:
        parser.error("--modes must include 0 (the baseline)")
    limit_threads(args.threads)
    asyncio.run(main(args))
