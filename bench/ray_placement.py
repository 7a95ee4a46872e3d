"""What the Ray placement costs, against the process placement measured in the same run.

- call rtt            a Ray-placed ``Echo`` vs the same actor as a ``process`` child over tcp
                      (a Ray member's child dials the supervisor over tcp, so this is the floor)
- SIGKILL -> answering again   the member's child process killed, until a call is answered by
                      the new one (Ray: a new Ray actor is placed and starts the child)
- digits step time    the digits recipe's mean time per training step with its rollout on Ray
                      vs on ``process``, and with every role (dataset, rollout, reward,
                      trainer) on Ray vs every role on ``process`` (``examples/digits_ray``;
                      issue 15's goal: within 10 %)

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

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECIPE = EXAMPLES / "digits" / "cluster.toml"
ALL_ON_RAY = EXAMPLES / "digits_ray" / "cluster.toml"
ROLES = ("dataset", "rollout", "reward", "trainer")


async def step_time(placement: str, steps: int, *, every_role: bool = False) -> float:
    """Mean seconds per applied training step of a digits run, its rollout (``every_role``:
    every role) on ``placement`` (the first step, which pays for starting everything, is left
    out)."""
    from relax import cluster
    from relax.config import load_config

    if every_role:  # the digits_ray recipe as it is, or with every role moved to `placement`
        recipe = ALL_ON_RAY
        overrides = [f'{role}.placement="{placement}"' for role in ROLES]
    else:
        recipe = RECIPE
        overrides = [f'rollout.placement="{placement}"']
        if placement == "ray":
            overrides.append("rollout.ray.num_cpus=1")
    overrides.append(f"trainer.steps={steps}")
    cfg = load_config(recipe, overrides=overrides)
    with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
        layout = await cluster.run(cfg, Path(tmp) / "run")
        rows = [json.loads(x) for x in (layout.run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if r.get("applied")]
    return (times[-1] - times[0]) / (len(times) - 1)


async def main(calls: int, rounds: int, steps: int) -> None:
    configure_logging(level="error")
    keys = ("ray", "tcp", "rr", "rt", "sr", "sp", "ar", "ap")
    results: dict[str, list[float]] = {k: [] for k in keys}
    with ray_session("local", num_cpus=6):
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
                results["ap"].append(await step_time("process", steps, every_role=True))
                results["ar"].append(await step_time("ray", steps, every_role=True))
    print(f"median of {rounds} rounds, {calls} sequential calls each")
    report("call rtt, ray vs process/tcp", results["ray"], results["tcp"], 1e6, "us")
    report("SIGKILL -> answering again", results["rr"], results["rt"], 1e3, "ms")
    if steps:
        report(
            f"digits step, rollout on ray ({steps} steps)", results["sr"], results["sp"], 1e3, "ms"
        )
        report("digits step, every role on ray", results["ar"], results["ap"], 1e3, "ms")


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
