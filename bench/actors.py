"""Actor runtime benchmarks: call round-trip (inproc, process over IPC and TCP) and restart.

Each figure is compared with a baseline measured in the same run, interleaved over several
rounds, and reported as medians with the ratio ours/baseline:

- inproc call   vs. a bare asyncio.Queue request/reply to a task (the floor for any mailbox)
- process call  vs. a bare pynng PAIR echo between two processes (the floor for any NNG hop)
- restart       vs. spawning the same interpreter and waiting for it to exit
                (the floor for any process restart)

Then the recovery budget of a real run (the digits recipe, every role and both buses in its own
process): each role is SIGKILLed ``--kills`` times and the time until it serves again is
reported per role (median, max). "Serving again": for a bus, its supervisor shows the new
process running and a client request is answered by it; for a role, the new process finished
``on_start`` (model loaded, bus connected) and runs. Kills are spaced so the run keeps going.
And what the run feels: SIGKILL -> training again, until the trainer logs a step after the
role served again (at
``--staleness 0`` by default, where rows a dead role held stall the whole run until they are
back: its restarted self takes them back as it connects, or their lease runs out, 60 s).

Run: ``python bench/actors.py [--calls 2000] [--rounds 5] [--kills 3] [--staleness 0]
[--no-roles]``. Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
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
        addr = f"ipc://{tempfile.gettempdir()}/relax-bench-{os.getpid()}.sock"
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


async def restart_latency(sup: Supervisor, child: str = "ipc") -> float:
    ref = sup.ref(child)
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


RECIPE = Path(__file__).resolve().parents[1] / "examples" / "digits" / "cluster.toml"
ROLES = ("prompts", "samples", "dataset", "reward-0", "trainer", "rollout-0")


def last_step_time(metrics: Path) -> float:
    """When the trainer logged its newest step (Unix seconds; 0 before any)."""
    if not metrics.exists():
        return 0.0
    with metrics.open("rb") as f:
        f.seek(max(0, metrics.stat().st_size - 8192))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return float(json.loads(line)["time"])
        except (ValueError, KeyError):
            continue  # a partial line (the seek, or a write in progress)
    return 0.0


async def role_recovery(
    kills: int, standby: bool, staleness: str
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per role of a running digits run (see the module docstring), SIGKILL -> serving again
    and SIGKILL -> training again; with ``standby``, each kill waits until every role's warm
    spare is ready."""
    from relax import cluster
    from relax.bus import BusClient
    from relax.config import load_config
    from tests.actors.helpers import find, wait_until

    overrides = [
        *(f'{r}.placement="process"' for r in ("dataset", "reward", "trainer", "rollout")),
        "trainer.steps=1000000",  # it must not finish while we kill it
        f"supervisor.intensity={len(ROLES) * kills + 1}",
        "supervisor.period=3600",
        f"supervisor.standby={str(standby).lower()}",
        f"staleness={staleness}",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    took: dict[str, list[float]] = {r: [] for r in ROLES}
    trained: dict[str, list[float]] = {r: [] for r in ROLES}
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        layout = cluster.prepare(cfg, Path(tmp) / "run")
        async with cluster.build_tree(cfg, layout) as tree:

            async def entry(role: str) -> dict:
                return find(await tree.snapshot(), role)

            async def running(role: str) -> list[int]:
                while True:
                    e = await entry(role)
                    if e["state"] == "running" and e["pids"]:
                        return e["pids"]
                    await asyncio.sleep(0.02)

            async def spare_ready(role: str) -> bool:
                return bool((await entry(role))["spares"])

            for role in ROLES:
                await running(role)
            urls = {"prompts": layout.prompts_url, "samples": layout.samples_url}
            for _ in range(kills):
                for role in ROLES:
                    old = (await running(role))[0]
                    await asyncio.sleep(1.0)  # let the run settle after the previous kill
                    if standby:
                        # Every role's spare, not only this one's: a spare still starting (the
                        # one replacing the previous kill's) is an interpreter importing torch,
                        # a core's worth of work that would slow this recovery, not be part of it.
                        for each in ROLES:
                            await wait_until(
                                lambda each=each: spare_ready(each), 120, f"{each}'s spare"
                            )
                    start = time.perf_counter()
                    os.kill(old, signal.SIGKILL)
                    while True:
                        e = await entry(role)
                        if e["state"] == "running" and e["pids"] and old not in e["pids"]:
                            break
                        await asyncio.sleep(0.02)
                    if role in urls:
                        async with await BusClient.connect(urls[role]) as bus:
                            await bus.statistics()
                    took[role].append(time.perf_counter() - start)
                    metrics, served_at = layout.run_dir / "metrics.jsonl", time.time()
                    await wait_until(  # a step logged after the role served again
                        lambda m=metrics, t=served_at: last_step_time(m) > t,
                        600,
                        "the trainer's next step",
                        interval=0.02,
                    )
                    trained[role].append(time.perf_counter() - start)
    return took, trained


async def main(calls: int, rounds: int, kills: int, staleness: str) -> None:
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
    if kills:
        cold, cold_trained = await role_recovery(kills, standby=False, staleness=staleness)
        warm, warm_trained = await role_recovery(kills, standby=True, staleness=staleness)
        bare = [spawn_baseline() for _ in range(rounds)]
        for title, c_all, w_all in (
            ("serving again", cold, warm),
            ("training again (a step after serving again)", cold_trained, warm_trained),
        ):
            print(
                f"recovery of a digits run at staleness {staleness}, SIGKILL -> {title} "
                f"({kills} kills each), cold (a new interpreter) and warm ([supervisor] "
                "standby: a spare takes over):"
            )
            for role in ROLES:
                c, w = c_all[role], w_all[role]
                print(
                    f"  {role:<12} cold median {statistics.median(c):6.2f} s  max {max(c):6.2f} s"
                    f"   warm median {statistics.median(w):6.2f} s  max {max(w):6.2f} s"
                    f"   warm/cold {statistics.median(w) / statistics.median(c):5.2f}x"
                )
        print(
            f"  bare interpreter start (python -c 'import relax.actors._host'): "
            f"median {statistics.median(bare):6.2f} s"
        )
        worst = max(statistics.median(warm[r]) for r in ROLES)
        print(f"recovery_warm_median_max = {worst:.3f}")
        worst = max(statistics.median(warm_trained[r]) for r in ROLES)
        print(f"training_again_warm_median_max = {worst:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per role of a run")
    parser.add_argument("--staleness", default="0", help="the run's bound: 0, k or inf")
    parser.add_argument("--no-roles", action="store_true", help="skip the run's recovery budget")
    args = parser.parse_args()
    kills = 0 if args.no_roles else args.kills
    asyncio.run(main(args.calls, args.rounds, kills, args.staleness))
