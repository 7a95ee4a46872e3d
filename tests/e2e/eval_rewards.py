"""A reward function for the evaluation test (``kind = "python"``, weight 0: it scores nothing).

``hold_first_eval`` holds the scoring of the evaluator's samples (held-out prompts: the built-in
task with seed 1, ids ``arith-1-…``) until the trainer has logged ``steps`` steps. Training
samples (``arith-0-…``) pass at once. So the first evaluation can only end if training goes on
while it is in flight: an evaluator that stalled the trainer would time out here instead.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from relax.rewards import Sample


async def hold_first_eval(
    response: str, sample: Sample, *, metrics: str, steps: int, deadline: float = 60.0
) -> float:
    if not sample.group.startswith("arith-1-"):
        return 0.0
    path, end = Path(metrics), time.monotonic() + deadline
    while not (path.exists() and len(path.read_text().splitlines()) >= steps):
        if time.monotonic() > end:
            raise TimeoutError(f"the trainer logged fewer than {steps} steps in {deadline}s")
        await asyncio.sleep(0.05)  # polling a condition, with a deadline
    return 0.0
