"""The HF engine's fast decode step against decoding through the model's forward pass.

Two ``HFEngine``s on the same saved model, one with ``fast_decode`` (the default: decode steps
through ``relax.engines._fast_decode``), one without (every step through ``model(...)``),
generate the same rollout calls — the digits recipe's prompts, 8 samples each, a seed per
prompt, ``rollout.max_new_tokens`` tokens — interleaved call by call; medians per call, the
ratio, and whether every token and logprob came out the same (they must: the logits are
bit-identical). Last line: ``fast_decode_speedup = forward-pass time / fast time``.

Run: ``python bench/fast_decode.py [--scale scaled|digits|100m] [--rows 16] [--threads 1]
[--calls 12]``. Like every timing here it wants an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import SCALES, limit_threads, quiet, recipe


async def main(args: argparse.Namespace) -> None:
    import torch

    from relax.engines import HFEngine, SamplingParams
    from relax.models import build_tiny_model, stop_token_ids
    from relax.roles._prompts import prompt_stream

    quiet()
    cfg = recipe("0", 1, args.scale)
    n = cfg.data.n_samples_per_prompt
    per_call = max(1, args.rows // n)
    with tempfile.TemporaryDirectory(prefix="relax-bench-fast-") as tmp:
        model_dir = build_tiny_model(cfg.model.init, Path(tmp) / "model")
        engines = {
            "forward pass": HFEngine.from_pretrained(model_dir, fast_decode=False),
            "fast": HFEngine.from_pretrained(model_dir),
        }
        assert engines["fast"]._fast is not None, "the recipe's model should take the fast path"
        tokenizer = engines["fast"].tokenizer
        params = SamplingParams.from_rollout(
            cfg.rollout, n=n, stop_token_ids=stop_token_ids(tokenizer)
        )
        prompts = prompt_stream(cfg.data.model_dump())
        took: dict[str, list[float]] = {name: [] for name in engines}
        identical = True
        for call in range(args.calls + 2):
            items = list(itertools.islice(prompts, per_call))
            ids = [tokenizer.encode(i["prompt"], add_special_tokens=False) for i in items]
            seeds = [call * 1000 + k for k in range(len(ids))]
            out = {}
            for name, engine in engines.items():
                started = time.perf_counter()
                out[name] = await engine.generate(ids, params, seeds=seeds)
                if call >= 2:  # the first two warm up
                    took[name].append(time.perf_counter() - started)
            a, b = out["fast"], out["forward pass"]
            identical &= [g.response_ids for g in a] == [g.response_ids for g in b]
            identical &= [g.logprobs for g in a] == [g.logprobs for g in b]
    medians = {name: statistics.median(t) for name, t in took.items()}
    print(
        f"digits/{args.scale} ({', '.join(SCALES[args.scale]) or 'as in the recipe'}); "
        f"{per_call * n} rows per call, {cfg.rollout.max_new_tokens} new tokens at most, "
        f"{torch.get_num_threads()} thread(s); median of {args.calls} calls each, interleaved"
    )
    for name, median in medians.items():
        print(f"  {name:<13} {median * 1e3:7.1f} ms per call")
    print(f"  tokens and logprobs identical: {identical}")
    print(f"fast_decode_speedup = {medians['forward pass'] / medians['fast']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", choices=tuple(SCALES), default="scaled")
    parser.add_argument("--rows", type=int, default=16, help="sequences per call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=12)
    args = parser.parse_args()
    limit_threads(args.threads)
    asyncio.run(main(args))
