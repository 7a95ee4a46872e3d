"""Weight publishing inside a running cluster, against memcpy of the same bytes in the same run.

A bus (``BusService``, persisted, in its own process, as ``relax up`` runs it) and one or two
receiver processes (``tests/bus/weight_plane_peer.py``: a rollout's weight follower without the
engine). The publisher (this process, the trainer's side) publishes a ~50 MB and a ~1 GB state
dict of float32 tensors:

- ``group``: the weight plane (``[weights] transport = "group"``) as it runs on one CPU
  machine by default (``local_file = "auto"``): the trainer writes each version into the
  bus's folder itself, the bus announces and commits it, and the receivers, which can read
  that folder, read it there, every bucket checked against the trainer's checksum (after
  their first version, which reaches them over the group);
- ``gloo``: the weight plane with ``local_file = "off"``: the bytes go over a gloo group with a
  checksum per bucket (what receivers on other machines get; NCCL on GPUs);
- ``bus``: every byte through the bus's RPC (``transport = "bus"``);
- ``ipc`` (``--device cuda`` only): the state dict on this process's GPU and the receivers'
  engines on the same GPU (the one-GPU layout): each bucket is handed over by CUDA IPC,
  device to device. With ``--device cuda`` every state dict is on the GPU (the other modes
  then stage it through host memory, as a GPU trainer with CPU rollouts does) and memcpy is a
  device-to-device copy.

A publish is timed from its start until the last receiver switched to it (the receivers print
``time.monotonic()``, one clock for every process of the machine). Baseline: ``Tensor.copy_``
of the same number of bytes. Each configuration first publishes a tiny version (forming the
group is not what a steady publish costs). Also measured: the publisher's peak extra resident
memory during the 1 GB group publish (sampled every 2 ms), against the bucket size.

Run: ``python bench/weights.py [--rounds 1] [--bucket-mb 64] [--device cuda] [--modes ipc,bus]``. The last lines are
machine-readable, one ``name = value`` each, ending with ``weights_gloo_vs_memcpy_1GB``,
``weights_group_vs_memcpy_1GB`` and ``weights_bus_vs_memcpy_1GB`` (to two receivers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relax.actors import ChildSpec, Process, Supervisor  # noqa: E402
from relax.bus import BusClient, BusService  # noqa: E402
from relax.bus._plane import PlaneOptions, WeightPublisher  # noqa: E402
from relax.log import configure_logging  # noqa: E402
from relax.transport import Limits  # noqa: E402

LIMITS = Limits(frame_bytes=8 << 20, max_message_bytes=1 << 30)
SIZES = {"50MB": 50 << 20, "1GB": 1 << 30}
MODES = ("group", "gloo", "bus")
PEER_MODE = {"group": "file", "gloo": "group", "bus": "bus", "ipc": "group"}  # the peer's modes
DEVICE = torch.device("cpu")  # --device
LEASE = 3.0


def state_of(nbytes: int) -> dict[str, torch.Tensor]:
    """float32 tensors of 16 MiB each (a layer's worth), plus the rest."""
    per = 4 << 20
    count, rest = divmod(nbytes // 4, per)
    state = {f"layers.{i}.weight": torch.randn(per) for i in range(count)}
    if rest:
        state["tail"] = torch.randn(rest)
    return {name: t.to(DEVICE) for name, t in state.items()}


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def memcpy_seconds(nbytes: int) -> float:
    src = torch.randn(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    synchronize()
    start = time.perf_counter()
    dst.copy_(src)
    synchronize()
    return time.perf_counter() - start


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The peak resident size above the one at entry, sampled every 2 ms on a thread (the
    process's own high-water mark would include earlier peaks, like memcpy's buffers)."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base


class Receivers:
    """Receiver processes, each printing one JSON line per version it switched to."""

    def __init__(self, url: str, count: int, mode: str, tag: str) -> None:
        self.url, self.count, self.mode, self.tag = url, count, mode, tag
        self.procs: list[asyncio.subprocess.Process] = []
        self.lines: list[dict] = []  # each receiver's last version line

    async def __aenter__(self) -> Receivers:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
        }
        for i in range(self.count):
            self.procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "tests.bus.weight_plane_peer",
                    self.url,
                    f"{self.tag}-{i}",
                    str(LEASE),
                    PEER_MODE[self.mode],
                    *(["nosum", "cuda"] if self.mode == "ipc" else []),
                    cwd=ROOT,
                    env=env,
                    stdout=asyncio.subprocess.PIPE,
                )
            )
        return self

    async def switched(self, version: int) -> float:
        """When the last receiver switched to ``version`` (``time.monotonic()``)."""
        times = []
        self.lines = []
        for proc in self.procs:
            while True:
                line = await asyncio.wait_for(proc.stdout.readline(), 600)  # type: ignore[union-attr]
                if not line:
                    raise RuntimeError("a receiver ended")
                if line.startswith(b"{") and json.loads(line)["version"] == version:
                    times.append(json.loads(line)["t"])
                    self.lines.append(json.loads(line))
                    break
        return max(times)

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            await proc.wait()


async def members(bus: BusClient, *, everyone: bool = False) -> list[str]:
    """The receivers the group carries bytes to (``everyone``: the file's readers too)."""
    group = list(await bus._call({"op": "w_members", "lease": LEASE}))  # expires old ones
    return sorted((await bus.statistics())["weights"]["members"]) if everyone else group


async def measure(
    url: str, mode: str, receivers: int, states: dict[str, dict], bucket_mb: int, first: int
) -> tuple[dict[str, float], int]:
    """Seconds per size for one (mode, receivers); and the group's peak extra memory."""
    out: dict[str, float] = {}
    extra = 0
    options = PlaneOptions(
        bucket_bytes=bucket_mb << 20, timeout=120.0, lease=LEASE, local_file=mode == "group"
    )
    async with (
        await BusClient.connect(url, limits=LIMITS) as bus,
        Receivers(url, receivers, mode, f"{mode}{receivers}-{first}") as peers,
    ):
        publisher = WeightPublisher(bus, options, device=DEVICE if mode == "ipc" else None)
        if mode != "bus":
            deadline = time.monotonic() + 120
            want = [f"{peers.tag}-{i}" for i in range(receivers)]
            # Exactly these: the last measurement's receivers must have left (their lease).
            # (Receivers reading the file may never need the group: count them all.)
            while await members(bus, everyone=mode == "group") != want:
                if time.monotonic() > deadline:
                    raise RuntimeError("receivers did not join")
                await asyncio.sleep(0.05)
        try:
            # A first small version: forming the group (and the receivers' first fetch) is
            # not what a steady publish costs.
            warm = {"w": torch.zeros(1024)}
            if mode != "bus":
                await publisher.publish(first, warm)
            else:
                await bus.publish_weights(first, warm)
            await peers.switched(first)
            if mode == "group":  # they checked the file after that first version: off the group
                while await members(bus):
                    if time.monotonic() > deadline:
                        raise RuntimeError("receivers did not leave the group for the file")
                    await asyncio.sleep(0.05)
            version = first + 1
            for name, state in states.items():
                before = dict(publisher.statistics())
                seen = list(peers.lines)
                if DEVICE.type == "cuda":
                    synchronize()
                    gpu_base = torch.cuda.memory_allocated(DEVICE)
                    torch.cuda.reset_peak_memory_stats(DEVICE)
                with PeakRss() as rss:
                    start = time.monotonic()
                    if mode != "bus":
                        await publisher.publish(version, state)
                    else:
                        await bus.publish_weights(version, state, bucket_bytes=bucket_mb << 20)
                    out[name] = await peers.switched(version) - start
                if mode != "bus":
                    stats = publisher.statistics()
                    out[f"{name}_transfer"] = stats["last_transfer_s"]
                    out[f"{name}_publish"] = stats["last_publish_s"]
                    for key in ("digest_s", "ipc_pack_s", "ipc_wait_s"):
                        out[f"{name}_pub_{key}"] = stats[key] - before[key]
                    for key in ("collective_s", "digest_s", "ipc_copy_s"):  # the slowest one
                        if seen and all(key in line for line in peers.lines):
                            out[f"{name}_recv_{key}"] = max(
                                line[key] - old[key]
                                for line, old in zip(peers.lines, seen, strict=True)
                            )
                if mode == "gloo" and name == "1GB" and DEVICE.type == "cpu":
                    extra = rss.extra
                if mode == "ipc" and name == "1GB":  # the publisher's extra GPU memory
                    extra = torch.cuda.max_memory_allocated(DEVICE) - gpu_base
                version += 1
        finally:
            await publisher.aclose()
    return out, extra


async def main(rounds: int, bucket_mb: int, modes: tuple[str, ...]) -> None:
    configure_logging(level="error")
    states = {name: state_of(n) for name, n in SIZES.items()}
    nbytes = {name: sum(t.numel() * 4 for t in s.values()) for name, s in states.items()}
    results: dict[str, list[float]] = {}
    extras: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        bus_kwargs = {
            "url": f"ipc://{tmp}/bus.sock",
            "run_dir": tmp,
            "staleness": "inf",
            "frame_bytes": LIMITS.frame_bytes,
            "max_message_bytes": LIMITS.max_message_bytes,
        }
        async with Supervisor(
            [ChildSpec("bus", BusService, kwargs=bus_kwargs, placement=Process())]
        ) as sup:
            url = await sup.ref("bus").call("address")
            version = 1
            for _ in range(rounds):
                for name, n in nbytes.items():
                    results.setdefault(f"memcpy_{name}", []).append(memcpy_seconds(n))
                for mode in modes:
                    for receivers in (1, 2):
                        took, extra = await measure(
                            url, mode, receivers, states, bucket_mb, version
                        )
                        version += len(states) + 1
                        if extra:
                            extras.append(extra)
                        for name, seconds in took.items():
                            results.setdefault(f"{mode}{receivers}_{name}", []).append(seconds)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"median of {rounds} round(s); bus persisted, in its own process; buckets {bucket_mb} MiB;"
        f" state dicts on {DEVICE}"
    )
    for name, n in nbytes.items():
        memcpy = med[f"memcpy_{name}"]
        print(f"{name}: memcpy {n / memcpy / 1e9:6.2f} GB/s ({memcpy * 1e3:8.1f} ms)")
        for mode in modes:
            for receivers in (1, 2):
                took = med[f"{mode}{receivers}_{name}"]
                parts = ""
                if mode != "bus":
                    transfer = med[f"{mode}{receivers}_{name}_transfer"]
                    publish = med[f"{mode}{receivers}_{name}_publish"]
                    parts = (
                        f"  (publish {publish * 1e3:.0f} ms, of it transfer {transfer * 1e3:.0f})"
                    )
                print(
                    f"  {mode:>5} to {receivers}: {took * 1e3:9.1f} ms  "
                    f"{n / took / 1e9:6.2f} GB/s  {memcpy / took:6.3f}x memcpy{parts}"
                )
                phases = [
                    f"{key[:-2].replace('_', ' ')} {med[f'{mode}{receivers}_{name}_{key}'] * 1e3:.0f}"
                    for key in (
                        "pub_digest_s",
                        "pub_ipc_pack_s",
                        "pub_ipc_wait_s",
                        "recv_collective_s",
                        "recv_digest_s",
                        "recv_ipc_copy_s",
                    )
                    if f"{mode}{receivers}_{name}_{key}" in med
                ]
                if phases:
                    print(f"        ms: {', '.join(phases)}")
    extra = statistics.median(extras) if extras else 0
    over = "CUDA IPC, GPU memory" if DEVICE.type == "cuda" else "the gloo group, resident"
    print(f"publisher peak extra memory, 1 GB over {over}: {extra / 2**20:.0f} MiB")
    for name in SIZES:
        for mode in modes:
            for receivers in (1, 2):
                ratio = med[f"memcpy_{name}"] / med[f"{mode}{receivers}_{name}"]
                print(f"weights_{mode}_to_{receivers}_vs_memcpy_{name} = {ratio:.4f}")
    print(f"weights_publish_extra_peak_MiB_1GB = {extra / 2**20:.0f}")
    if "ipc" in modes and "gloo" in modes:  # the one-GPU layout against host staging
        print(f"weights_ipc_vs_gloo_1GB = {med['gloo2_1GB'] / med['ipc2_1GB']:.3f}")
    for mode in modes:  # the headline figures: 1 GB to two
        print(f"weights_{mode}_vs_memcpy_1GB = {med['memcpy_1GB'] / med[f'{mode}2_1GB']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--device", default="cpu", help='where the state dicts are: "cpu", "cuda"')
    parser.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    args = parser.parse_args()
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and DEVICE.index is None:
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    default = (("ipc",) if DEVICE.type == "cuda" else ()) + MODES
    chosen = tuple(args.modes.split(",")) if args.modes else default
    unknown = sorted(set(chosen) - {*MODES, "ipc"})
    if unknown or ("ipc" in chosen and DEVICE.type != "cuda"):
        parser.error(f"modes are {', '.join(MODES)} and (with --device cuda) ipc; got {chosen}")
    asyncio.run(main(args.rounds, args.bucket_mb, chosen))
