"""R3 (Rollout Routing Replay) on the MoE recipe: the trainer's step time and the
training/inference mismatch with replay on and off, in the same run.

``examples/moe`` (a tiny Qwen3-MoE policy on the digits task; the rollout samples in bf16, the
trainer trains in fp32) runs ``--rounds`` times with ``trainer.routing_replay`` on and off,
interleaved (the order alternates per round), each a fresh ``relax up`` with the same seeds.
Per run: the median of the trainer's ``step_time_s`` (forward, backward and optimiser: what
replay adds to), the mean ``mismatch_kl`` and ``mismatch_max`` (the trainer's log-probs of the
sampled tokens against the sampler's, before the update), the mean ``router_disagreement``
and the final reward.

Run: ``python bench/r3.py [--rounds 3] [--steps 40]``. Last lines, machine-readable:
``r3_overhead = …`` (median over rounds of step time on ÷ off, minus 1; goal ≤ 0.02) and
``r3_mismatch_ratio = …`` (mismatch_kl with replay ÷ without, medians over rounds; goal well
below 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "moe" / "cluster.toml"


def run(replay: bool, steps: int, folder: Path) -> dict[str, float]:
    """One run of the recipe; its figures."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    command = [
        sys.executable,
        "-m",
        "relax.cli",
        "up",
        str(RECIPE),
        "--run-dir",
        str(folder),
        "--set",
        f"trainer.steps={steps}",
        "--set",
        f"trainer.routing_replay={'true' if replay else 'false'}",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r.get("applied")]
    return {
        "step_ms": statistics.median(r["step_time_s"] for r in steps_rows) * 1e3,
        "mismatch_kl": statistics.mean(r["mismatch_kl"] for r in steps_rows),
        "mismatch_max": statistics.mean(r["mismatch_max"] for r in steps_rows),
        "disagreement": statistics.mean(r.get("router_disagreement", 0.0) for r in steps_rows),
        "reward_last10": statistics.mean(r["reward_mean"] for r in steps_rows[-10:]),
    }


def main(rounds: int, steps: int) -> None:
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            order = (True, False) if index % 2 == 0 else (False, True)
            for replay in order:
                figures = run(replay, steps, Path(tmp) / f"{index}-{int(replay)}")
                results[replay].append(figures)
                print(
                    f"round {index + 1} replay {'on ' if replay else 'off'}: "
                    + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()),
                    flush=True,
                )
    on, off = results[True], results[False]
    overheads = [a["step_ms"] / b["step_ms"] - 1 for a, b in zip(on, off, strict=True)]

    def med(side: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in side)

    print(f"medians of {rounds} interleaved round(s), {steps} steps each:")
    for key in ("step_ms", "mismatch_kl", "mismatch_max", "disagreement", "reward_last10"):
        print(f"  {key:>14}: replay on {med(on, key):.4g}, off {med(off, key):.4g}")
    print(f"r3_step_ms_on = {med(on, 'step_ms'):.2f}")
    print(f"r3_step_ms_off = {med(off, 'step_ms'):.2f}")
    print(f"r3_mismatch_max_ratio = {med(on, 'mismatch_max') / med(off, 'mismatch_max'):.4f}")
    print(f"r3_overhead = {statistics.median(overheads):.4f}")
    print(f"r3_mismatch_ratio = {med(on, 'mismatch_kl') / med(off, 'mismatch_kl'):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    main(args.rounds, args.steps)
