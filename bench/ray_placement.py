"""What the Ray placement costs, against the process placement measured in the same run.

- call rtt            a Ray-placed ``Echo`` vs the same actor as a ``process`` child over tcp
                      (a Ray member's child dials the supervisor over tcp, so this is the floor)
- SIGKILL -> answering again   the member's child process killed, until a call is answered by
                      the new one (Ray: a new Ray actor is placed and starts the child)
- digits step time    the digits recipe's mean time per training step with its rollout on Ray
                      vs on ``process`` (issue 15's goal: within 10 %)

Rounds are interleaved (ours, baseline, ours, …) so the machine's noise is shared; medians and
the ratio ours/baseline are printed. A private Ray instance on 127.0.0.1 is started for the run.

Run: ``python bench/ray_placement.py [--calls 1000] [--rounds 5] [--steps 20] [--no-recipe]``.
Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors import actor_calls, report, restart_latency  # bench/actors.py, this folder

from relax.actors import ChildSpec, Process, Ray, Supervisor, ray_session
from relax.log import configure_logging
from tests.actors.fixtures import Echo

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "digits" / "cluster.toml"


async def step_time(placement: str, steps: int) -> float:
    """Mean seconds per applied training step of a digits run, its rollout on ``placement``
    (the first step, which pays for starting everything, is left out)."""
    from relax import cluster
    from relax.config import load_config

    overrides = [f'rollout.placement="{placement}"', f"trainer.steps={steps}"]
    if placement == "ray":
        overrides.append("rollout.ray.num_cpus=1")
    cfg = load_config(RECIPE, overrides=overrides)
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        layout = await cluster.run(cfg, Path(tmp) / "run")
        rows = [json.loads(x) for x in (layout.run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if r.get("applied")]
    return (times[-1] - times[0]) / (len(times) - 1)


async def main(calls: int, rounds: int, steps: int) -> None:
    configure_logging(level="error")
    results: dict[str, list[float]] = {k: [] for k in ("ray", "tcp", "rr", "rt", "sr", "sp")}
    with ray_session("local", num_cpus=4):
        children = [
            ChildSpec("ray", Echo, placement=Ray(num_cpus=1)),
            ChildSpec("tcp", Echo, placement=Process(transport="tcp")),
        ]
        async with Supervisor(children, intensity=2 * rounds + 1, period=3600) as sup:
            for _ in range(rounds):
                results["tcp"].append(await actor_calls(sup, "tcp", calls))
                results["ray"].append(await actor_calls(sup, "ray", calls))
                results["rt"].append(await restart_latency(sup, "tcp"))
                results["rr"].append(await restart_latency(sup, "ray"))
        if steps:
            for _ in range(max(1, rounds // 2)):
                results["sp"].append(await step_time("process", steps))
                results["sr"].append(await step_time("ray", steps))
    print(f"median of {rounds} rounds, {calls} sequential calls each")
    report("call rtt, ray vs process/tcp", results["ray"], results["tcp"], 1e6, "us")
    report("SIGKILL -> answering again", results["rr"], results["rt"], 1e3, "ms")
    if steps:
        report(f"digits step ({steps} steps)", results["sr"], results["sp"], 1e3, "ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="training steps per recipe run")
    parser.add_argument("--no-recipe", action="store_true", help="skip the digits step time")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds, 0 if args.no_recipe else args.steps))
