"""TransferQueue benchmarks, each against a baseline measured in the same run.

1. put -> take throughput (rows/s, MB/s) for 1 KB, 64 KB and 1 MB rows: a producer task puts
   rows into a bus in another process while a consumer task takes and acks them, against a raw
   pynng relay doing the same data movement with no bus logic (REQ/REP to a process that keeps
   payloads in a deque: one request carries a payload in, another carries it out).
2. weights: publish a 50 MB state dict in buckets and have a subscriber poll it whole, against
   a plain memcpy of the same bytes (``torch.Tensor.copy_``).
3. training rows (128 prompt + 512 response ids, 512 logprobs and a reward, as lists: what the
   rollout puts): put -> take rows/s, and what checking them at the door (``check_rows``, the
   declared column types) costs per row, measured on its own.

Rounds are interleaved and medians reported. The last lines are machine-readable, one
``name = value`` each. Run: ``python bench/bus.py [--rounds 3] [--persist/--no-persist]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pynng
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relax.actors import ChildSpec, Process, Supervisor  # noqa: E402
from relax.bus import BusClient, BusService  # noqa: E402
from relax.bus._columns import check_rows  # noqa: E402
from relax.log import configure_logging  # noqa: E402
from relax.transport import Limits  # noqa: E402

RELAY = """
import collections, sys, pynng
s = pynng.Rep0(recv_max_size=0)
s.listen(sys.argv[1])
q = collections.deque()
while True:
    m = s.recv()
    if m[:1] == b"P":
        q.append(m[1:]); s.send(b"ok")
    else:
        s.send(q.popleft() if q else b"")
"""

SIZES = {"1KB": 1 << 10, "64KB": 64 << 10, "1MB": 1 << 20}
LIMITS = Limits(frame_bytes=8 << 20, max_message_bytes=256 << 20)


def rows_for(size: int, count: int, tag: str) -> list[list[dict]]:
    payload = torch.zeros(size, dtype=torch.uint8)
    batch = max(1, min(64, (4 << 20) // size))
    out = []
    for start in range(0, count, batch):
        out.append(
            [
                {
                    "uid": f"{tag}-{i}",
                    "group": f"{tag}-{i}",
                    "version": 0,
                    "columns": {"x": payload},
                }
                for i in range(start, min(start + batch, count))
            ]
        )
    return out


async def put_take_seconds(url: str, batches: list[list[dict]]) -> float:
    """Seconds one producer takes to put ``batches`` while one consumer takes them all."""
    count = sum(len(b) for b in batches)
    async with (
        await BusClient.connect(url, limits=LIMITS) as producer,
        await BusClient.connect(url, limits=LIMITS) as consumer,
    ):

        async def produce() -> None:
            for batch in batches:
                await producer.put(batch)

        async def consume() -> None:
            got = 0
            while got < count:
                async with consumer.take("train", batch_size=len(batches[0]), wait=5) as batch:
                    got += len(batch)

        start = time.perf_counter()
        await asyncio.gather(produce(), consume())
        return time.perf_counter() - start


async def bus_throughput(url: str, size: int, count: int, tag: str) -> float:
    """put -> take bytes/s of rows of ``size`` bytes."""
    return count * size / await put_take_seconds(url, rows_for(size, count, tag))


def training_rows(count: int, tag: str, batch: int = 16) -> list[list[dict]]:
    response = list(range(512))
    columns = {
        "prompt_ids": list(range(128)),
        "response_ids": response,
        "logprobs": [-0.5] * len(response),
        "reward": 1.0,
        "answer": "42",
    }
    rows = [
        {"uid": f"{tag}-{i}", "group": f"{tag}-{i}", "version": 0, "columns": columns}
        for i in range(count)
    ]
    return [rows[i : i + batch] for i in range(0, count, batch)]


async def bus_training_rows(url: str, count: int, tag: str) -> float:
    """put -> take rows/s of training rows."""
    return count / await put_take_seconds(url, training_rows(count, tag))


def check_cost_us(count: int = 2000) -> float:
    """Microseconds ``check_rows`` spends on one training row."""
    rows = [r for batch in training_rows(count, "check") for r in batch]
    start = time.perf_counter()
    check_rows(rows)
    return (time.perf_counter() - start) / count * 1e6


async def raw_throughput(url: str, size: int, count: int) -> float:
    payload = b"P" + bytes(size)
    with pynng.Req0(recv_max_size=0) as put_sock, pynng.Req0(recv_max_size=0) as take_sock:
        put_sock.dial(url, block=True)
        take_sock.dial(url, block=True)

        async def produce() -> None:
            for _ in range(count):
                await put_sock.asend(payload)
                await put_sock.arecv()

        async def consume() -> None:
            got = 0
            while got < count:
                await take_sock.asend(b"T")
                if len(await take_sock.arecv()) > 1:
                    got += 1

        start = time.perf_counter()
        await asyncio.gather(produce(), consume())
        return count * size / (time.perf_counter() - start)


async def weights_bandwidth(url: str, version: int) -> float:
    state = {f"w{i}": torch.randn(1 << 20) for i in range(12)} | {
        "tail": torch.randn(524_288)
    }  # 50 MB
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    async with (
        await BusClient.connect(url, limits=LIMITS) as trainer,
        await BusClient.connect(url, limits=LIMITS) as rollout,
    ):
        start = time.perf_counter()
        await trainer.publish_weights(
            version, state, bucket_bytes=16 << 20, set_trainer_version=False
        )
        got = await rollout.poll_weights(after=version - 1)
        took = time.perf_counter() - start
    assert got is not None and torch.equal(got[1]["tail"], state["tail"])
    return nbytes / took


async def weights_group_bandwidth(url: str, version: int) -> float:
    """The same 50 MB, with the bytes over a gloo tensor group to a subscriber process."""
    import socket

    from relax.transport import open_group

    state = weights_state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        group_url = f"nccl://127.0.0.1:{s.getsockname()[1]}"
    peer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.bus.weights_peer",
        url,
        str(version - 1),
        group_url,
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
    )
    # open_group returns once every rank joined: the subscriber is up when the clock starts.
    async with (
        await open_group(group_url, rank=0, world_size=2, timeout=120) as group,
        await BusClient.connect(url, limits=LIMITS) as trainer,
    ):
        start = time.perf_counter()
        await trainer.publish_weights(
            version, state, bucket_bytes=16 << 20, set_trainer_version=False, group=group
        )
        took = time.perf_counter() - start
    await peer.wait()
    return nbytes / took


def weights_state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.randn(1 << 20) for i in range(12)} | {
        "tail": torch.randn(524_288)
    }  # 50 MB


def memcpy_bandwidth() -> float:
    src = torch.randn(50 * (1 << 20) // 4)
    dst = torch.empty_like(src)
    start = time.perf_counter()
    dst.copy_(src)
    return src.numel() * 4 / (time.perf_counter() - start)


async def main(rounds: int, persist: bool) -> None:
    configure_logging(level="error")
    with tempfile.TemporaryDirectory() as tmp:
        relay_url = f"ipc://{tmp}/relay.sock"
        bus_url = f"ipc://{tmp}/bus.sock"
        relay = subprocess.Popen([sys.executable, "-c", RELAY, relay_url])
        bus_kwargs = {
            "url": bus_url,
            "run_dir": tmp,
            "persist": persist,
            "capacity": 512,
            "staleness": "inf",
            "frame_bytes": LIMITS.frame_bytes,
            "max_message_bytes": LIMITS.max_message_bytes,
        }
        results: dict[str, list[float]] = {}
        try:
            async with Supervisor(
                [ChildSpec("bus", BusService, kwargs=bus_kwargs, placement=Process())]
            ):
                for r in range(rounds):
                    for name, size in SIZES.items():
                        count = max(200, min(5000, (256 << 20) // size // 4))
                        results.setdefault(f"raw_{name}", []).append(
                            await raw_throughput(relay_url, size, count)
                        )
                        results.setdefault(f"bus_{name}", []).append(
                            await bus_throughput(bus_url, size, count, f"{name}-{r}")
                        )
                    results.setdefault("train_rows", []).append(
                        await bus_training_rows(bus_url, 2000, f"train-{r}")
                    )
                    results.setdefault("check_us", []).append(check_cost_us())
                    results.setdefault("memcpy", []).append(memcpy_bandwidth())
                    results.setdefault("weights", []).append(
                        await weights_bandwidth(bus_url, 2 * r + 1)
                    )
                    results.setdefault("weights_group", []).append(
                        await weights_group_bandwidth(bus_url, 2 * r + 2)
                    )
        finally:
            relay.kill()
            relay.wait()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"median of {rounds} rounds; bus on ipc in its own process; persist={persist}")
    for name, size in SIZES.items():
        bus, raw = med[f"bus_{name}"], med[f"raw_{name}"]
        print(
            f"put->take {name:>5}: bus {bus / size:9.0f} rows/s {bus / 1e6:8.1f} MB/s | "
            f"raw pynng {raw / size:9.0f} rows/s {raw / 1e6:8.1f} MB/s | ratio {bus / raw:4.2f}"
        )
    print(
        f"weights 50 MB: through the bus {med['weights'] / 1e6:8.1f} MB/s | over a gloo group "
        f"{med['weights_group'] / 1e6:8.1f} MB/s | memcpy {med['memcpy'] / 1e6:8.1f} MB/s"
    )
    share = med["check_us"] * med["train_rows"] / 1e6
    print(
        f"training rows (640 ids + 512 logprobs): bus {med['train_rows']:8.0f} rows/s | "
        f"checking one at the door {med['check_us']:6.1f} us ({share:.1%} of the bus's time)"
    )
    for name in SIZES:
        print(f"bus_vs_raw_pynng_{name} = {med[f'bus_{name}'] / med[f'raw_{name}']:.3f}")
    print(f"bus_training_rows_per_s = {med['train_rows']:.0f}")
    print(f"check_rows_us_per_training_row = {med['check_us']:.2f}")
    print(f"weights_bus_vs_memcpy_50MB = {med['weights'] / med['memcpy']:.4f}")
    print(f"weights_vs_memcpy_50MB = {med['weights_group'] / med['memcpy']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--persist", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.persist))
