"""Length-sorted micro-batches (``[trainer] sort_micro_batches``) against the rows in the order
taken, in one run.

One training step (``TorchBackend``, as the trainer role builds it, one torch thread) on 64
rows that the scaled digits model (``bench._common.SCALES``) with the wide-spread policy of
``bench/length_schedule.py`` generated (8 prompts x 8 samples, 96-token cap: lengths from 1 to
the cap, about half at it), cut into micro-batches of ``--micro`` rows. Each micro-batch is
computed up to its longest row; sorted, rows of similar length share one. Every round steps a
fresh copy of the same weights on the same rows both ways (the order flipped every round)
and checks that the two gradients agree.

The last lines are ``name = value``: ``sorted_vs_unsorted_step`` (step time unsorted ÷
sorted: > 1 is faster) and ``sorted_positions_share`` (token positions computed, sorted ÷
unsorted).

Run: ``python bench/micro_batches.py [--rounds 5] [--micro 8]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (
    limit_threads,
    load_average,
    median,
    quiet,
    recipe,
    spread_model,
    spread_of,
)

PROMPTS, SAMPLES, MAX_NEW = 8, 8, 96


async def spread_rows(model_dir: Path) -> list[dict]:
    """64 rows of the wide-spread policy, as the rollout puts them (rewards 0/1 alternating
    inside each group: every group has a signal)."""
    from relax.engines import HFEngine, SamplingParams
    from relax.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    engine = HFEngine.from_pretrained(model_dir)
    prompts = [tok.encode(f"{a}+{a + 3}=", add_special_tokens=False) for a in range(PROMPTS)]
    params = SamplingParams(n=SAMPLES, max_new_tokens=MAX_NEW, stop_token_ids=[tok.eos_token_id])
    gens = await engine.generate(prompts, params, seeds=list(range(PROMPTS)))
    return [
        {
            "prompt_ids": g.prompt_ids,
            "response_ids": g.response_ids,
            "logprobs": g.logprobs,
            "reward": float(k % 2),
            "group": f"g{k // SAMPLES}",
        }
        for k, g in enumerate(gens)
    ]


def main(rounds: int, micro: int) -> None:
    import torch

    from relax.models import load_policy
    from relax.training import TorchBackend

    cfg = recipe("0", 1, "scaled")
    with tempfile.TemporaryDirectory(prefix="relax-bench-micro-") as tmp:
        model_dir = spread_model(Path(tmp))
        rows = asyncio.run(spread_rows(model_dir))
        model, tok = load_policy(model_dir, "float32")
    trainer = cfg.trainer.model_copy(
        update={"micro_batch_size": micro, "global_batch_size": len(rows)}
    )
    times: dict[bool, list[float]] = {True: [], False: []}
    positions: dict[bool, int] = {}
    for round_ in range(rounds):
        grads = {}
        for sort in (True, False) if round_ % 2 == 0 else (False, True):
            replica = copy.deepcopy(model)
            seen: list[int] = []
            hook = replica.register_forward_pre_hook(
                lambda m, a, kw, seen=seen: seen.append(kw["input_ids"].numel()), with_kwargs=True
            )
            backend = TorchBackend(
                replica,
                trainer.model_copy(update={"sort_micro_batches": sort}),
                cfg.algorithm,
                pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            )
            started = time.perf_counter()
            _, problem = backend.compute_gradients(rows)
            times[sort].append(time.perf_counter() - started)
            hook.remove()
            if problem is not None:
                raise SystemExit(f"the step was refused: {problem}")
            positions[sort] = sum(seen)
            grads[sort] = [p.grad.clone() for p in replica.parameters() if p.grad is not None]
        for a, b in zip(grads[True], grads[False], strict=True):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
                raise SystemExit("sorting changed the gradient")
    med = {sort: median(values) for sort, values in times.items()}
    lengths = spread_of([len(r["response_ids"]) for r in rows])
    print(
        f"{len(rows)} rows, response lengths (min, quartiles, max) {lengths}; micro-batches of"
        f" {micro}; forward + backward (medians of {rounds}): sorted {med[True] * 1e3:.1f} ms"
        f" ({positions[True]} token positions), unsorted {med[False] * 1e3:.1f} ms"
        f" ({positions[False]}); the same gradient every round"
    )
    print(f"load average: {load_average()}")
    print(f"sorted_vs_unsorted_step = {med[False] / med[True]:.3f}")
    print(f"sorted_positions_share = {positions[True] / positions[False]:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro", type=int, default=8)
    args = parser.parse_args()
    limit_threads(1)
    quiet()
    main(args.rounds, args.micro)
