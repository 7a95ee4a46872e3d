"""What recording a run for `relax replay` costs, and how fast a replay runs.

The digits recipe (rollout and trainer in their own processes, one thread each; ``--scale
scaled`` for a wider model with 32-token answers) runs ``--rounds`` times with ``[trainer]
record`` on and off, interleaved (the order alternates per round), each a fresh cluster with
the same seeds. Per run: seconds per step after a warm-up (the whole pipeline, as a user sees
it) and, with the record on, its bytes on disk per step. Then each recorded run is replayed
(``relax.replay.replay``) and the replay's seconds per step and its verdict are printed.

Run: ``python bench/replay.py [--rounds 3] [--steps 40] [--scale digits|scaled]``. Last lines:
``record_bytes_per_step = …``, ``replay_vs_run = …`` (a replay's speed over the run's, medians)
and ``record_overhead = …`` (median over rounds of step time on ÷ off, minus 1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import limit_threads, quiet, recipe, timed_run  # noqa: E402

WARMUP = 5


def main(rounds: int, steps: int, scale: str) -> None:
    from relax.replay import RECORD_DIR, replay

    periods: dict[bool, list[float]] = {True: [], False: []}
    sizes: list[float] = []
    replays: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            order = (True, False) if index % 2 == 0 else (False, True)
            for record in order:
                cfg = recipe("1", steps, scale, extra=(f"trainer.record={str(record).lower()}",))
                folder = Path(tmp) / f"{index}-{int(record)}"
                run = asyncio.run(timed_run(cfg, folder))
                period = run.period(WARMUP)
                periods[record].append(period)
                line = f"round {index + 1} record {'on ' if record else 'off'}: {period * 1e3:.1f} ms/step"
                if record:
                    size = sum(p.stat().st_size for p in (folder / RECORD_DIR).rglob("*"))
                    sizes.append(size / steps)
                    report = replay(folder)
                    replays.append(report.wall_s / report.steps)
                    verdict = (
                        "identical" if report.identical else f"DIVERGED {report.divergences[0]}"
                    )
                    line += (
                        f", record {size / steps / 1024:.1f} KiB/step;"
                        f" replay {report.wall_s / report.steps * 1e3:.1f} ms/step, {verdict}"
                    )
                print(line, flush=True)
    overheads = [a / b - 1 for a, b in zip(periods[True], periods[False], strict=True)]
    on, off = statistics.median(periods[True]), statistics.median(periods[False])
    print(f"medians of {rounds} interleaved round(s), {steps} steps each ({scale}):")
    print(f"  step: record on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms")
    print(f"  replay: {statistics.median(replays) * 1e3:.1f} ms/step")
    print(f"record_bytes_per_step = {statistics.median(sizes):.0f}")
    print(f"replay_vs_run = {on / statistics.median(replays):.2f}")
    print(f"record_overhead = {statistics.median(overheads):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--scale", choices=("digits", "scaled"), default="digits")
    args = parser.parse_args()
    limit_threads(1)
    quiet()
    main(args.rounds, args.steps, args.scale)
