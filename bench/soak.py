"""A long run under seeded SIGKILLs: does anything grow, leak or get lost over 2,000 steps?

The digits recipe (``examples/digits``, staleness 1) with the rollout, reward and trainer in
processes of their own, for ``--steps`` steps; every ``--kill-every`` applied steps a seeded
choice of rollout, reward or trainer is SIGKILLed at a seeded moment (its supervisor restarts
it). Every ``--sample`` seconds it records, per process of the tree: resident memory
(``VmRSS``) and open file descriptors; and the run folder's bus logs on disk (the samples and
prompts buses' segment logs, which compaction keeps bounded).

Reported: wall time per 100 steps (each hundred, and the second half's median ÷ the first
half's: flat is ~1), each process's resident memory at the end of the first 10 % of the run
and its peak after (growth in MiB), the bus logs' largest size per tenth of the run (bounded:
compaction deletes whole segments, ``--segment-mib`` each, behind the oldest live row), the
most descriptors any process held, the restarts, and the exactly-once audit: ``twice`` = row
uids the trainer's ledger trained more than once, ``lost`` = rows the samples bus took in
(``put``) that were neither trained, nor dropped with a counted reason, nor still waiting on
the bus at the end (the bus's own counters; the bus is not killed here, so they cover the
whole run). Then the trainer's record: its size, and a `relax replay` of the whole run, which
must re-execute every step bit for bit, each trainer restart as it happened.

Run: ``python bench/soak.py [--steps 2000] [--kill-every 50] [--seed 0] [--segment-mib 4]``. Last line:
``soak: 2000 steps, rss_growth = … MiB, log_bytes_max = …, lost = 0, twice = 0``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import limit_threads, quiet  # noqa: E402
from relax import cluster  # noqa: E402
from relax.config import load_config  # noqa: E402
from relax.replay import RECORD_DIR, replay  # noqa: E402

RECIPE = ROOT / "examples" / "digits" / "cluster.toml"
TARGETS = ("rollout-0", "reward-0", "trainer")


def proc_status(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open descriptors) of ``pid``; ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None
    return rss, fds


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def applied(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = text[: text.rfind("\n") + 1].splitlines()
    return [r for r in map(json.loads, lines) if r.get("applied")]


class AppliedCounter:
    """Applied steps so far, reading only what the trainer appended since the last look: this
    process is also the supervisor's, whose memory is measured (re-reading the whole growing
    file five times a second would grow it with the file)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.count, self.inode = path, 0, 0, None

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.inode:  # a restarted trainer rewrote it: count it afresh
                    self.inode, self.offset, self.count = inode, 0, 0
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return 0
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        self.count += complete.count(b'"applied": true')
        return self.count


def bus_counters(log_dir: Path) -> tuple[Counter[str], int]:
    """The samples bus's counters at the end of the run, and the rows still on it untrained:
    its table rebuilt from its own log (snapshot and tail, as a restarting bus does)."""
    import math

    from relax.bus._log import SegmentLog
    from relax.bus._table import BusTable
    from relax.transport import loads

    with SegmentLog(log_dir) as log:
        ops = [(seq, loads(record)) for seq, record in log.replay()]
    tasks = {"train"} | {op["task"] for _, op in ops if op.get("task")}
    table = BusTable(tasks=tuple(sorted(tasks)), capacity=1 << 30, staleness=math.inf)
    for seq, op in ops:
        table.apply(op, seq)
    return table.counters, len(table.rows)


def tree_pids(snapshot: dict[str, Any]) -> dict[str, int]:
    """Child id -> its (first) pid, for children that have one of their own."""
    out = {"supervisor": os.getpid()}  # with the children placed "inproc" (the dataset)
    for child in snapshot["children"]:
        if child.get("pids") and int(child["pids"][0]) != os.getpid():
            out[child["id"]] = int(child["pids"][0])
    return out


async def soak(
    steps: int, kill_every: int, seed: int, sample_s: float, segment_mib: int
) -> dict[str, Any]:
    overrides = [
        f"trainer.steps={steps}",
        'rollout.placement="process"',
        'reward.placement="process"',
        'trainer.placement="process"',
        'bus.transport="ipc"',
        "bus.lease_timeout=5",
        f"supervisor.intensity={steps}",  # the kills are the point: never give up on them
        "supervisor.period=60",
        # Small segments, so that 2,000 steps of this small recipe show compaction recycling
        # them (the default, 64 MiB, outlasts the run: nothing would be released yet).
        f"bus.segment_bytes={segment_mib << 20}",
    ]
    cfg = load_config(RECIPE, overrides=overrides)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        layout = cluster.prepare(cfg, Path(tmp) / "run")
        run_dir = layout.run_dir
        count_applied = AppliedCounter(run_dir / "metrics.jsonl")
        samples: list[dict[str, Any]] = []
        kills: Counter[str] = Counter()
        started = time.monotonic()
        async with cluster.build_tree(cfg, layout) as tree:
            finished = asyncio.create_task(tree.wait())
            next_kill = kill_every
            last_sample = 0.0
            while not finished.done():
                done = count_applied()
                now = time.monotonic()
                if now - last_sample >= sample_s:
                    last_sample = now
                    snap = await tree.snapshot()
                    procs = {
                        name: status
                        for name, pid in tree_pids(snap).items()
                        if (status := proc_status(pid)) is not None
                    }
                    logs = disk_bytes(run_dir / "samples" / "bus-log")
                    logs += disk_bytes(run_dir / "prompts" / "bus-log")
                    samples.append(
                        {"t": now - started, "steps": done, "procs": procs, "logs": logs}
                    )
                if done >= next_kill and done < steps - kill_every // 2:
                    target = rng.choice(TARGETS)
                    await asyncio.sleep(rng.uniform(0.0, 0.5))  # a random moment of a step
                    pid = tree_pids(await tree.snapshot()).get(target)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        kills[target] += 1
                    next_kill += kill_every
                await asyncio.wait({finished}, timeout=0.2)
            snap = await tree.snapshot()
        counters, waiting = bus_counters(run_dir / "samples" / "bus-log")
        records = applied(run_dir)
        ledger = [
            json.loads(line) for line in (run_dir / "trainer-ledger.jsonl").read_text().splitlines()
        ]
        record_bytes = disk_bytes(run_dir / RECORD_DIR)
        # The whole run's trainer again, from its record, restarts included: bit for bit?
        replayed = replay(run_dir)
    trained = Counter(uid for line in ledger if line["applied"] for uid, _ in line["items"])
    dropped = sum(
        v for k, v in counters.items() if k.startswith("dropped_") and k != "dropped_with_group"
    )
    return {
        "records": records,
        "samples": samples,
        "kills": kills,
        "restarts": {c["id"]: c["restart_count"] for c in snap["children"] if c["restart_count"]},
        "twice": sum(1 for n in trained.values() if n > 1),
        "lost": counters.get("put", 0) - counters.get("trained", 0) - dropped - waiting,
        "put": counters.get("put", 0),
        "trained": counters.get("trained", 0),
        "dropped": dropped,
        "waiting": waiting,
        "wall_s": time.monotonic() - started,
        "record_bytes": record_bytes,
        "replay": replayed,
    }


def report(result: dict[str, Any], steps: int) -> None:
    records, samples = result["records"], result["samples"]
    times = [r["time"] for r in records]
    per_100 = [times[i + 99] - times[i] for i in range(0, len(times) - 99, 100)]
    print(f"{len(records)} steps in {result['wall_s']:.0f} s; kills {dict(result['kills'])}")
    print(f"restarts {result['restarts']}")
    if len(per_100) >= 4:
        # The first hundred has fewer kills behind it; flat = the second half as fast as the first.
        half = len(per_100) // 2
        print(
            "wall per 100 steps (s): "
            + " ".join(f"{x:.1f}" for x in per_100)
            + f"  (median {statistics.median(per_100):.1f}; second half ÷ first half"
            f" {statistics.median(per_100[half:]) / statistics.median(per_100[:half]):.2f})"
        )
    # Memory: each process's RSS once the run settled (10 % in) against its peak after.
    settle = next(
        (s for s in samples if s["steps"] >= steps // 10), samples[0] if samples else None
    )
    growth = 0.0
    if settle is not None:
        print("resident memory (MiB) at 10 % → peak after, and the most descriptors held:")
        for name in sorted(settle["procs"]):
            base = settle["procs"][name][0]
            after = [
                s["procs"][name] for s in samples if s["t"] >= settle["t"] and name in s["procs"]
            ]
            peak = max(rss for rss, _ in after)
            fds = max(fd for _, fd in after)
            # A restarted process starts over: its growth is its peak over its own settle.
            grew = (peak - base) / 2**20
            growth = max(growth, grew)
            tenths = [
                max(
                    (
                        s["procs"][name][0]
                        for s in samples
                        if i * steps // 10 <= s["steps"] < (i + 1) * steps // 10
                        and name in s["procs"]
                    ),
                    default=0,
                )
                for i in range(10)
            ]
            print(
                f"  {name:>10}: {base / 2**20:7.1f} → {peak / 2**20:7.1f} (+{grew:.1f}), fds {fds};"
                " per tenth " + " ".join(f"{x / 2**20:.0f}" for x in tenths)
            )
    log_max = max((s["logs"] for s in samples), default=0)
    tenths = [
        max(
            (s["logs"] for s in samples if i * steps // 10 <= s["steps"] < (i + 1) * steps // 10),
            default=0,
        )
        for i in range(10)
    ]
    print(
        "bus logs on disk, largest per tenth of the run (MiB): "
        + " ".join(f"{x / 2**20:.1f}" for x in tenths)
    )
    fds_max = max((fd for s in samples for _, fd in s["procs"].values()), default=0)
    print(
        f"bus logs on disk: max {log_max / 2**20:.1f} MiB; most descriptors in a process {fds_max}"
    )
    print(
        f"rows: put {result['put']}, trained {result['trained']}, dropped {result['dropped']},"
        f" waiting at the end {result['waiting']}"
    )
    replayed = result["replay"]
    print(
        f"record: {result['record_bytes'] / 2**20:.1f} MiB"
        f" ({result['record_bytes'] / max(len(records), 1) / 1024:.1f} KiB per step); replay:"
        f" {'identical' if replayed.identical else 'DIVERGED at ' + str(replayed.divergences[0])},"
        f" {replayed.compared} values compared, {replayed.restarts} trainer restarts,"
        f" {replayed.steps} steps in {replayed.wall_s:.0f} s"
    )
    print(
        f"soak: {len(records)} steps, rss_growth = {growth:.1f} MiB, log_bytes_max = {log_max},"
        f" lost = {result['lost']}, twice = {result['twice']}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--kill-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--segment-mib", type=int, default=4, help="bus log segment size")
    args = parser.parse_args()
    limit_threads(1)
    quiet()
    report(
        asyncio.run(soak(args.steps, args.kill_every, args.seed, args.sample, args.segment_mib)),
        args.steps,
    )
