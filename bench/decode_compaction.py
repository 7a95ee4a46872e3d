"""The HF engine's decode batch compaction (finished rows leave the forward passes) against
keeping every row of a batch to its longest, in one run.

The rollout's engine (``HFEngine``, one torch thread, as a rollout process runs it) on the
scaled digits model (``bench._common.SCALES``), one call of 8 prompts x 8 samples with
per-prompt seeds, as a rollout makes it:

- ``spread``: the policy of ``bench/length_schedule.py`` (``tests.tiny.spread_lengths``):
  responses from 1 token to the cap, about half at it — where a batch waits for its longest;
- ``uniform``: the same policy with no stop token: every response runs to the cap, nothing
  finishes early, so this shows what the bookkeeping costs when compaction has nothing to
  drop.

Both engines produce the same tokens (checked every call); the time of a call is timed,
rounds interleaved (the order flipped every round). The last lines are ``name = value``:
``compaction_vs_full_spread`` and ``compaction_vs_full_uniform`` (time kept ÷ time
compacted: > 1 is faster).

Run: ``python bench/decode_compaction.py [--rounds 5] [--max-new-tokens 96]`` (about a
minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import limit_threads, load_average, median, quiet, spread_model, spread_of

PROMPTS = 8
SAMPLES = 8


async def main(rounds: int, max_new_tokens: int) -> None:
    from relax.engines import HFEngine, SamplingParams
    from relax.models import load_tokenizer

    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="relax-bench-compaction-") as tmp:
        model_dir = spread_model(Path(tmp))
        tok = load_tokenizer(model_dir)
        for policy in ("spread", "uniform"):
            stops = [tok.eos_token_id] if policy == "spread" else []
            prompts = [
                tok.encode(f"{a}+{b}=", add_special_tokens=False)
                for a, b in zip(range(PROMPTS), range(3, 3 + PROMPTS), strict=True)
            ]
            engines = {
                "compacted": HFEngine.from_pretrained(model_dir, compact=True),
                "full": HFEngine.from_pretrained(model_dir, compact=False),
            }
            times: dict[str, list[float]] = {name: [] for name in engines}
            lengths: list[int] = []
            for round_ in range(rounds):
                seeds = [1000 * round_ + k for k in range(PROMPTS)]
                params = SamplingParams(
                    n=SAMPLES, max_new_tokens=max_new_tokens, stop_token_ids=stops
                )
                order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
                tokens = {}
                for name in order:
                    started = time.perf_counter()
                    gens = await engines[name].generate(prompts, params, seeds=seeds)
                    times[name].append(time.perf_counter() - started)
                    tokens[name] = [g.response_ids for g in gens]
                if tokens["compacted"] != tokens["full"]:
                    raise SystemExit(f"{policy}: compaction changed the tokens in round {round_}")
                lengths += [len(t) for t in tokens["full"]]
            med = {name: median(values) for name, values in times.items()}
            ratios[policy] = med["full"] / med["compacted"]
            print(
                f"{policy:>8}: {PROMPTS * SAMPLES} rows per call, response lengths (min, quartiles,"
                f" max) {spread_of(lengths)}; compacted {med['compacted'] * 1e3:.1f} ms, full"
                f" {med['full'] * 1e3:.1f} ms per call (medians of {rounds});"
                f" same tokens every call"
            )
    print(f"load average: {load_average()}")
    for policy, ratio in ratios.items():
        print(f"compaction_vs_full_{policy} = {ratio:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    limit_threads(1)
    quiet()
    asyncio.run(main(args.rounds, args.max_new_tokens))
