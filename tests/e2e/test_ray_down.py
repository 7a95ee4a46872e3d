"""`relax down` of a run on a Ray cluster it did not start: every Ray actor and placement group
of the run is gone afterwards, checked by `relax down` and again here from Ray's own tables.

The cluster is ``ray.cluster_utils.Cluster`` on 127.0.0.1 (two raylets), started by this
module; `relax up --detach` joins it by address, in the run's own namespace.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relax.actors import RAY_INSTALL_HINT, run_namespace
from relax.runfiles import RayInfo, read_ray_info, write_ray_info
from tests.e2e.test_cli_ops import relax, status
from tests.optional import require
from tests.polling import poll_until
from tests.ray_nodes import loopback_cluster

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "digits_ray" / "cluster.toml"

require("ray", "RELAX_REQUIRE_RAY", RAY_INSTALL_HINT, whole_module=True)


@pytest.fixture(scope="module")
def cluster() -> Any:
    # Logical CPUs enough on node-b for the pinned rollout beside every other role: Ray may put
    # an unpinned role there too (its scheduler spreads), and the rollout must still fit.
    with loopback_cluster(4, node_b={"num_cpus": 4, "resources": {"node-b": 1}}) as nodes:
        yield nodes


def _of_namespace(namespace: str) -> tuple[list[str], list[str]]:
    """The named actors of ``namespace`` and the live groups named for it, from Ray."""
    import ray

    actors = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace
    ]
    groups = [
        g["name"]
        for g in ray.util.placement_group_table().values()
        if g["state"] != "REMOVED" and g["name"].startswith(f"relax:{namespace}:")
    ]
    return sorted(actors), groups


@pytest.mark.timeout(600)
def test_relax_down_leaves_no_ray_actor_of_the_run(cluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # The recipe sizes a private instance (num_cpus), which a config joining a cluster refuses.
    recipe = tmp_path / "cluster.toml"
    recipe.write_text(
        "".join(line for line in RECIPE.read_text().splitlines(True) if "num_cpus" not in line)
    )
    up = relax(
        "up", recipe, "--detach", "--run-dir", run,
        "--set", f'cluster.ray.address="{cluster.address}"',
        "--set", "trainer.steps=100000",  # still running when we look
        "--set", 'rollout.ray.resources={"node-b"=0.1}',  # on the second raylet
        timeout=300,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr[-3000:]
    info = read_ray_info(run)
    assert info is not None and info.namespace == run_namespace(run.name), info
    assert not info.local and info.gcs_address == cluster.address, info

    def placed() -> bool:
        tree = status(run)["tree"]
        return all(
            c["state"] == "running" and (c.get("stats") or {}).get("node_id")
            for c in tree["children"]
            if c["placement"] == "ray"
        )

    poll_until(placed, timeout=240, what="every role of the run running on Ray")
    actors, _ = _of_namespace(info.namespace)
    roles = {name.split(":")[1] for name in actors}
    assert roles >= {"dataset", "rollout-0", "reward-0", "trainer"}, actors

    down = relax("down", "--run-dir", run, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "no Ray actor or placement group of the run is left" in down.stdout, down.stdout
    assert _of_namespace(info.namespace) == ([], [])  # and Ray's own tables agree


_LEAVE_BEHIND = """
import sys, ray
from relax.actors import ray_connection

@ray.remote
class Stray:
    def ping(self):
        return 1

with ray_connection(sys.argv[1], sys.argv[2]):
    # Detached: they outlive this driver, as a hung driver's would outlive its run.
    stray = Stray.options(name="relax:rollout-0:0:feedbeef", lifetime="detached", num_cpus=0)
    ray.get(stray.remote().ping.remote())
    group = ray.util.placement_group(
        [{"CPU": 0.1}], name=f"relax:{sys.argv[2]}:trainer:feedbeef", lifetime="detached"
    )
    ray.get(group.ready())
"""


@pytest.mark.timeout(300)
def test_relax_down_removes_what_ray_did_not_clean_up(cluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    namespace = run_namespace(run.name)
    left = subprocess.run(
        [sys.executable, "-c", _LEAVE_BEHIND, cluster.address, namespace],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert left.returncode == 0, left.stderr[-3000:]
    assert _of_namespace(namespace) == (
        ["relax:rollout-0:0:feedbeef"],
        [f"relax:{namespace}:trainer:feedbeef"],
    )
    # A run whose cluster process is gone (killed), its Ray objects still there.
    write_ray_info(run, RayInfo(cluster.address, namespace, local=False))

    down = relax("down", "--run-dir", run, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "nothing to stop" in down.stdout
    assert "removed what Ray had not cleaned up: actor relax:rollout-0:0:feedbeef" in down.stderr
    assert "no Ray actor or placement group of the run is left" in down.stdout, down.stdout
    assert _of_namespace(namespace) == ([], [])


def test_relax_down_fails_when_the_run_s_ray_cluster_does_not_answer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_ray_info(run, RayInfo("127.0.0.1:9", run_namespace(run.name), local=False))
    down = relax("down", "--run-dir", run, timeout=60)
    # Nothing runs there, so nothing to stop; what Ray holds cannot be checked: said so.
    assert down.returncode == 0 and "nothing to stop" in down.stdout, down.stdout + down.stderr
    assert "does not answer: cannot check that no Ray actor of the run is left" in down.stderr
