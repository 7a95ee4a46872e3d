"""Actor runtime benchmarks: call round-trip (inproc, process over IPC and TCP) and restart.

Each figure is compared with a baseline measured in the same run, interleaved over several
rounds, and reported as medians with the ratio ours/baseline:

- inproc call   vs. a bare asyncio.Queue request/reply to a task (the floor for any mailbox)
- process call  vs. a bare pynng PAIR echo between two processes (the floor for any NNG hop)
- restart       vs. spawning the same interpreter and waiting for it to exit
                (the floor for any process restart)

Run: ``python bench/actors.py [--calls 2000] [--rounds 5]``. Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pynng

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax.actors import ChildSpec, Process, Supervisor
from relax.errors import ActorDead
from relax.log import configure_logging
from tests.actors.fixtures import Echo

ECHO_SERVER = """
import sys, pynng
s = pynng.Pair0(recv_max_size=0)
s.dial(sys.argv[1], block=True)
while True:
    s.send(s.recv())
"""


async def queue_baseline(calls: int) -> float:
    requests: asyncio.Queue = asyncio.Queue(128)

    async def server() -> None:
        while True:
            fut, a, b = await requests.get()
            fut.set_result(a + b)

    task = asyncio.create_task(server())
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    for i in range(calls):
        fut = loop.create_future()
        await requests.put((fut, i, 1))
        await fut
    took = time.perf_counter() - start
    task.cancel()
    return took / calls


async def pynng_baseline(calls: int, transport: str) -> float:
    if transport == "ipc":
        addr = f"ipc:///tmp/relax-bench-{os.getpid()}.sock"
    else:
        addr = "tcp://127.0.0.1:0"
    with pynng.Pair0(recv_max_size=0) as sock:
        sock.listen(addr)
        if transport == "tcp":
            addr = "tcp://" + str(sock.listeners[0].local_address)
        proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, addr])
        try:
            payload = b"x" * 64
            await sock.asend(payload)
            await sock.arecv()
            start = time.perf_counter()
            for _ in range(calls):
                await sock.asend(payload)
                await sock.arecv()
            return (time.perf_counter() - start) / calls
        finally:
            proc.kill()
            proc.wait()


async def actor_calls(sup: Supervisor, child: str, calls: int) -> float:
    ref = sup.ref(child)
    await ref.call("add", 0, 1)
    start = time.perf_counter()
    for i in range(calls):
        await ref.call("add", i, 1)
    return (time.perf_counter() - start) / calls


async def restart_latency(sup: Supervisor) -> float:
    ref = sup.ref("ipc")
    pid = await ref.call("pid")
    start = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            if await ref.call("pid", timeout=10) != pid:
                return time.perf_counter() - start
        except ActorDead:
            continue


def spawn_baseline() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import relax.actors._host"], check=True)
    return time.perf_counter() - start


def report(name: str, ours: list[float], base: list[float], unit: float, unit_name: str) -> None:
    o, b = statistics.median(ours), statistics.median(base)
    print(
        f"{name:<28} ours {o * unit:9.1f} {unit_name}   baseline {b * unit:9.1f} {unit_name}   ratio {o / b:5.2f}x"
    )


async def main(calls: int, rounds: int) -> None:
    configure_logging(level="error")
    children = [
        ChildSpec("inproc", Echo),
        ChildSpec("ipc", Echo, placement=Process(transport="ipc")),
        ChildSpec("tcp", Echo, placement=Process(transport="tcp")),
    ]
    results: dict[str, list[float]] = {
        k: [] for k in ("q", "in", "nipc", "ipc", "ntcp", "tcp", "r", "sp")
    }
    async with Supervisor(children, intensity=rounds + 1, period=3600) as sup:
        for _ in range(rounds):  # interleave ours and the baselines: the machine's noise is shared
            results["q"].append(await queue_baseline(calls))
            results["in"].append(await actor_calls(sup, "inproc", calls))
            results["nipc"].append(await pynng_baseline(calls, "ipc"))
            results["ipc"].append(await actor_calls(sup, "ipc", calls))
            results["ntcp"].append(await pynng_baseline(calls, "tcp"))
            results["tcp"].append(await actor_calls(sup, "tcp", calls))
            results["sp"].append(spawn_baseline())
            results["r"].append(await restart_latency(sup))
    print(
        f"median of {rounds} rounds, {calls} sequential calls each (python {sys.version.split()[0]})"
    )
    report("call rtt, inproc", results["in"], results["q"], 1e6, "us")
    report("call rtt, process over ipc", results["ipc"], results["nipc"], 1e6, "us")
    report("call rtt, process over tcp", results["tcp"], results["ntcp"], 1e6, "us")
    report("SIGKILL -> answering again", results["r"], results["sp"], 1e3, "ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds))
