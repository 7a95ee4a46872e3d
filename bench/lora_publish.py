"""LoRA weight sync against full weights, measured in the same run.

One publish is what a training step costs the weights channel, end to end: the trainer's
``state_dict_for_publish`` (CPU copies), ``publish_weights`` to a bus in another process
(persisted to disk, as in a run), the rollout's ``poll_weights`` and ``HFEngine.load_weights``.
Two trainer/engine pairs built from the same model folder do it in turn, round after round: one
training every weight, one training ``[model.lora]`` adapters (``--rank``, every linear layer
of the decoder blocks). Each round takes one optimiser step on both (so every publish carries
new values), then times one publish of each. Reported: bytes per publish, median milliseconds
per publish (and its parts), and the LoRA/full ratios; also decode speed of each engine, since
the unmerged adapter adds a rank-r side path to every forward.

The model is built on the spot (``--hidden``, ``--layers``, ``--vocab``; the default is a
~28M-parameter Qwen2, ~110 MB in float32). Run: ``python bench/lora_publish.py [--rounds 7]``.
The last lines are machine-readable, one ``name = value`` each. Nothing here is asserted in
tests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relax.actors import ChildSpec, Process, Supervisor  # noqa: E402
from relax.bus import BusClient, BusService  # noqa: E402
from relax.config import (  # noqa: E402
    AlgorithmConfig,
    LoraConfig,
    ModelInitConfig,
    TrainerConfig,
)
from relax.engines import HFEngine, SamplingParams  # noqa: E402
from relax.log import configure_logging  # noqa: E402
from relax.models import build_tiny_model, load_policy  # noqa: E402
from relax.training import make_backend  # noqa: E402
from relax.transport import Limits  # noqa: E402

LIMITS = Limits(frame_bytes=8 << 20, max_message_bytes=1 << 30)


class Side:
    """One trainer and the engine it publishes to, over its own pair of bus clients."""

    def __init__(self, name: str, folder: Path, lora: LoraConfig | None) -> None:
        self.name = name
        model, _ = load_policy(folder)
        trainer = TrainerConfig(lr=1e-3, micro_batch_size=8, global_batch_size=8)
        self.backend = make_backend(trainer, AlgorithmConfig(), model, 0, 1.0, lora=lora)
        self.engine = HFEngine.from_pretrained(folder, lora=lora)
        self.times: dict[str, list[float]] = {"total": [], "copy": [], "bus": [], "load": []}
        self.nbytes = 0

    async def step(self) -> None:
        """One optimiser step on the engine's own samples (new values to publish)."""
        gens = await self.engine.generate(
            [[257, 50, 43, 51, 61]] * 2, SamplingParams(max_new_tokens=4, n=4, seed=0)
        )
        rows = [
            {
                "prompt_ids": g.prompt_ids,
                "response_ids": g.response_ids,
                "logprobs": g.logprobs,
                "reward": float(g.index % 2),
                "group": str(i // 4),
            }
            for i, g in enumerate(gens)
        ]
        assert self.backend.step(rows).applied

    async def publish(self, trainer: BusClient, rollout: BusClient, version: int) -> None:
        started = time.perf_counter()
        state = self.backend.state_dict_for_publish()
        copied = time.perf_counter()
        await trainer.publish_weights(version, state, set_trainer_version=False)
        got = await rollout.poll_weights(after=version - 1, wait=60)
        received = time.perf_counter()
        assert got is not None and got[0] == version
        await self.engine.load_weights(*got)
        done = time.perf_counter()
        self.nbytes = sum(t.numel() * t.element_size() for t in state.values())
        for key, value in (
            ("total", done - started),
            ("copy", copied - started),
            ("bus", received - copied),
            ("load", done - received),
        ):
            self.times[key].append(value)

    async def tokens_per_second(self) -> float:
        params = SamplingParams(max_new_tokens=32, n=8, seed=1)
        started = time.perf_counter()
        gens = await self.engine.generate([[257, 50, 43, 51, 61]] * 2, params)
        return sum(len(g.response_ids) for g in gens) / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> None:
    configure_logging(level="error")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        init = ModelInitConfig(
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            num_kv_heads=max(1, args.hidden // 256),
            intermediate_size=args.hidden * 11 // 4,
            vocab_size=args.vocab,
        )
        folder = build_tiny_model(init, Path(tmp) / "model")
        lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
        sides = [Side("full", folder, None), Side("lora", folder, lora)]
        params = sum(p.numel() for p in load_policy(folder)[0].parameters())
        bus_kwargs = {
            "url": f"ipc://{tmp}/bus.sock",
            "run_dir": str(Path(tmp) / "bus"),
            "staleness": "inf",
            "frame_bytes": LIMITS.frame_bytes,
            "max_message_bytes": LIMITS.max_message_bytes,
        }
        speed: dict[str, list[float]] = {"full": [], "lora": []}
        async with (
            Supervisor([ChildSpec("bus", BusService, kwargs=bus_kwargs, placement=Process())]),
            await BusClient.connect(bus_kwargs["url"], limits=LIMITS) as trainer,
            await BusClient.connect(bus_kwargs["url"], limits=LIMITS) as rollout,
        ):
            version = 0
            for r in range(args.rounds + 1):  # round 0 warms up, not counted
                for side in sides if r % 2 else reversed(sides):
                    await side.step()
                    version += 1
                    await side.publish(trainer, rollout, version)
                    if r == 0:
                        side.times = {key: [] for key in side.times}
                    else:
                        speed[side.name].append(await side.tokens_per_second())
    full, lora_side = sides
    med = {s.name: {k: statistics.median(v) * 1e3 for k, v in s.times.items()} for s in sides}
    print(
        f"model: {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers,"
        f" vocab {args.vocab}); LoRA rank {args.rank} on every linear layer of the blocks;"
        f" {args.rounds} rounds, medians"
    )
    for side in sides:
        m = med[side.name]
        print(
            f"{side.name:>4}: {side.nbytes / 1e6:9.3f} MB per publish | {m['total']:8.2f} ms"
            f" (copy {m['copy']:.2f}, bus {m['bus']:.2f}, engine load {m['load']:.2f}) |"
            f" decode {statistics.median(speed[side.name]):7.0f} tokens/s"
        )
    bytes_ratio = lora_side.nbytes / full.nbytes
    time_ratio = med["lora"]["total"] / med["full"]["total"]
    decode_ratio = statistics.median(speed["lora"]) / statistics.median(speed["full"])
    print(f"lora/full: bytes {bytes_ratio:.4f}, time {time_ratio:.4f}, decode {decode_ratio:.3f}")
    print(f"full_publish_bytes = {full.nbytes}")
    print(f"lora_publish_bytes = {lora_side.nbytes}")
    print(f"full_publish_ms = {med['full']['total']:.3f}")
    print(f"lora_publish_ms = {med['lora']['total']:.3f}")
    print(f"lora_vs_full_bytes = {bytes_ratio:.5f}")
    print(f"lora_vs_full_time = {time_ratio:.5f}")
    print(f"lora_vs_full_decode = {decode_ratio:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
