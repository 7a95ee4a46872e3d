"""The weight publish overlapped with the next training step (``[weights] overlap``), against
the publish before it, measured in the same run.

The digits recipe at staleness 1 with its rollout in its own process and a wider model than the
recipe's (``--hidden``, ``--layers``: the publish must weigh something), run with ``overlap =
"on"`` and ``overlap = "off"`` in interleaved rounds (on, off, on, …, so the machine's noise is
shared). Per run: the median time per applied step after the first ``--warmup`` steps (from
the steps' end times in ``metrics.jsonl``), and the share of steps whose publish overlapped.
Medians over rounds, and the ratio off/on (above 1: overlap is faster).

Run: ``python bench/publish_overlap.py [--rounds 3] [--steps 120] [--hidden 256] [--layers 4]``.
The last line is ``publish_overlap_speedup = …``. Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relax import cluster  # noqa: E402
from relax.config import load_config  # noqa: E402
from relax.log import configure_logging  # noqa: E402

RECIPE = ROOT / "examples" / "digits" / "cluster.toml"


async def one_run(overlap: bool, args: argparse.Namespace) -> tuple[float, float, int]:
    """(median seconds per step, share of steps overlapped, parameters) of one run."""
    overrides = [
        'weights.overlap="on"' if overlap else 'weights.overlap="off"',
        "staleness=1",
        'rollout.placement="process"',
        f"trainer.steps={args.steps}",
        f"model.init.hidden_size={args.hidden}",
        f"model.init.intermediate_size={args.hidden * 2}",
        f"model.init.num_layers={args.layers}",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        layout = await cluster.run(cfg, Path(tmp) / "run")
        lines = (layout.run_dir / "metrics.jsonl").read_text().splitlines()
        size = sum(
            p.stat().st_size for p in (layout.model_dir).glob("*.safetensors")
        )  # bytes of weights: what each publish moves
    records = [json.loads(line) for line in lines if line.strip()]
    applied = [r for r in records if r["applied"]][args.warmup :]
    times = [b["time"] - a["time"] for a, b in itertools.pairwise(applied)]
    share = sum(bool(r.get("publish_overlapped")) for r in applied) / max(1, len(applied))
    return statistics.median(times), share, size


async def main(args: argparse.Namespace) -> None:
    configure_logging(level="error")
    results: dict[bool, list[float]] = {True: [], False: []}
    shares: dict[bool, list[float]] = {True: [], False: []}
    size = 0
    for _ in range(args.rounds):
        for overlap in (True, False):
            step, share, size = await one_run(overlap, args)
            results[overlap].append(step)
            shares[overlap].append(share)
    on, off = (statistics.median(results[k]) for k in (True, False))
    print(
        f"digits at staleness 1, {args.layers} layers of {args.hidden} ({size / 2**20:.1f} MiB of"
        f" weights per publish), {args.steps} steps, median of {args.rounds} interleaved rounds"
    )
    print(
        f"  overlap on : {on * 1e3:7.1f} ms/step  ({statistics.median(shares[True]):.0%} overlapped)"
    )
    print(
        f"  overlap off: {off * 1e3:7.1f} ms/step  ({statistics.median(shares[False]):.0%} overlapped)"
    )
    print(f"publish_overlap_speedup = {off / on:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
