"""The ``Ray`` placement on a real Ray cluster of this machine: a head node and a node
``node-b`` (its own raylet, custom resource ``node-b``), every node on 127.0.0.1, started
once for the module (``ray.cluster_utils.Cluster``) and torn down after it.

Without ray installed the Ray tests skip, unless ``RELAX_REQUIRE_RAY=1`` (CI), where a
missing ray fails them. The config and preflight tests at the end need no running Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from relax.actors import RAY_INSTALL_HINT, ChildSpec, Ray, Supervisor
from relax.config import parse_config
from relax.errors import ActorDead, CallTimeout, ConfigError, StartFailed
from relax.log import log_files
from relax.preflight import preflight
from tests.actors.fixtures import Echo, GangWorld
from tests.actors.helpers import find, pid_alive
from tests.optional import require
from tests.polling import wait_until
from tests.ray_nodes import add_node, loopback_cluster

try:
    import ray
except ImportError:  # the fixture below decides: skip, or fail under RELAX_REQUIRE_RAY=1
    ray = None

slow = pytest.mark.slow


def _require_ray() -> None:
    require("ray", "RELAX_REQUIRE_RAY", RAY_INSTALL_HINT)


@pytest.fixture(scope="module")
def cluster() -> Any:
    """A head (2 CPUs) and ``node-b`` (1 CPU, resource ``node-b``), both on 127.0.0.1."""
    _require_ray()
    with loopback_cluster(2, node_b={"num_cpus": 1, "resources": {"node-b": 1}}) as nodes:
        yield nodes


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _ray_actor(actor_id: str) -> dict[str, Any]:
    """Ray's own record of an actor (from its control store; no dashboard needed)."""
    return ray._private.state.actors(actor_id=actor_id)


async def _answers_from_a_new_pid(sup: Supervisor, child: str, old: int) -> bool:
    try:
        return await sup.ref(child).call("pid", timeout=2) != old
    except (ActorDead, CallTimeout):
        return False  # a call that raced the death; the next one waits for the restart


@slow
@pytest.mark.anyio
async def test_a_ray_child_answers_calls_and_casts_and_reports_its_node(cluster) -> None:
    async with Supervisor([ChildSpec("r", Echo, placement=Ray(num_cpus=0.5))]) as sup:
        ref = sup.ref("r")
        pid = await ref.call("pid")
        assert pid != os.getpid() and pid_alive(pid)
        assert await ref.call("add", 2, b=5) == 7
        await ref.cast("bump", 3)
        assert await ref.call("get_count") == 3  # the cast arrived before this call
        with pytest.raises(ValueError, match="far on ray"):
            await ref.call("boom", "far on ray")
        entry = find(await sup.snapshot(), "r")
        stats = entry["stats"]
        assert entry["placement"] == "ray" and entry["pids"] == [pid]
        assert stats["node_id"] in _alive_nodes() and stats["node_ip"] == "127.0.0.1"
        assert stats["ray_pid"] != pid and pid_alive(stats["ray_pid"])  # its Ray actor
        # Not Ray's default nice 15 (a starved launcher): its launcher and the child doing
        # the work both run at the node's own priority.
        assert (
            stats["nice"]
            == os.getpriority(os.PRIO_PROCESS, pid)
            == os.getpriority(os.PRIO_PROCESS, stats["ray_pid"])
            == os.getpriority(os.PRIO_PROCESS, 0)
        )
        assert _ray_actor(stats["ray_actor_id"])["State"] == "ALIVE"
        assert stats["calls"] >= 4 and stats["casts"] == 1
    assert not pid_alive(pid)
    await wait_until(
        lambda: _ray_actor(stats["ray_actor_id"])["State"] == "DEAD",
        what="its Ray actor to be gone once the child stopped",
    )


@slow
@pytest.mark.anyio
async def test_sigkill_of_the_child_is_a_signal_exit_and_our_supervisor_restarts_it(
    cluster,
) -> None:
    async with Supervisor([ChildSpec("k", Echo, placement=Ray(num_cpus=0.5))], intensity=3) as sup:
        old = await sup.ref("k").call("pid")
        first = find(await sup.snapshot(), "k")["stats"]
        os.kill(old, signal.SIGKILL)
        await wait_until(
            lambda: _answers_from_a_new_pid(sup, "k", old), timeout=30, what="a restart"
        )
        entry = find(await sup.snapshot(), "k")
        crash = entry["last_crash"]
        assert crash["kind"] == "signal" and crash["signal"] == "SIGKILL", crash
        assert entry["restart_count"] == 1
        assert (await sup.snapshot())["restarts_in_period"] == 1  # counted by the intensity
        # Ray did not restart anything: the old Ray actor is dead, a new one hosts the child.
        assert entry["stats"]["ray_actor_id"] != first["ray_actor_id"]
        old_actor = _ray_actor(first["ray_actor_id"])
        assert old_actor["State"] == "DEAD" and old_actor["NumRestarts"] == 0, old_actor


@slow
@pytest.mark.anyio
async def test_sigkill_of_the_ray_actor_reaches_our_supervisor_with_ray_s_cause(cluster) -> None:
    async with Supervisor([ChildSpec("w", Echo, placement=Ray(num_cpus=0.5))], intensity=3) as sup:
        old = await sup.ref("w").call("pid")
        first = find(await sup.snapshot(), "w")["stats"]
        os.kill(first["ray_pid"], signal.SIGKILL)  # the Ray worker; its child dies with it
        await wait_until(
            lambda: _answers_from_a_new_pid(sup, "w", old), timeout=30, what="a restart"
        )
        entry = find(await sup.snapshot(), "w")
        assert entry["last_crash"]["kind"] == "ray", entry["last_crash"]
        assert "worker process has died" in entry["last_crash"]["message"]
        assert entry["restart_count"] == 1 and not pid_alive(old)
        assert _ray_actor(first["ray_actor_id"])["NumRestarts"] == 0  # max_restarts=0


@slow
@pytest.mark.anyio
async def test_a_child_no_node_can_host_waits_for_resources_without_burning_intensity(
    cluster,
) -> None:
    placement = Ray(num_cpus=0.5, resources={"node-c": 0.1}, start_timeout=30)
    spec = ChildSpec("nowhere", Echo, placement=placement)
    with pytest.raises(StartFailed) as info:  # the placement alone says so, at once
        await placement.launch(spec)
    cause = info.value.cause
    assert cause.kind == "placement" and "node-c" in cause.message, cause
    assert not [a for a in ray._private.state.actors().values() if a["State"] == "PENDING_CREATION"]
    # Under a supervisor (intensity 0: a single counted restart would stop the tree) the
    # child waits, shown as such, while its siblings run and calls to it wait too.
    children = [spec, ChildSpec("here", Echo, placement=Ray(num_cpus=0.5))]
    async with Supervisor(children, intensity=0) as sup:
        waiting = find(await sup.snapshot(), "nowhere")
        assert waiting["state"] == "waiting" and "node-c" in waiting["waiting"], waiting
        assert await sup.ref("here").call("add", 1, b=1) == 2
        pending = asyncio.create_task(sup.ref("nowhere").call("add", 2, b=3, timeout=60))
        assert find(await sup.snapshot(), "nowhere")["state"] == "waiting"  # it ran meanwhile
        assert not pending.done()  # a caller waits for the child, as during a restart
        node_c = add_node(cluster, num_cpus=1, resources={"node-c": 1})
        try:
            assert await pending == 5  # it started once a node with node-c joined
            entry = find(await sup.snapshot(), "nowhere")
            assert entry["state"] == "running" and entry["waiting"] is None, entry
            assert entry["stats"]["node_id"] == node_c.node_id
            assert entry["restart_count"] == 0 and entry["last_crash"] is None, entry
            assert (await sup.snapshot())["restarts_in_period"] == 0
        finally:
            await sup.terminate_child("nowhere")
            cluster.remove_node(node_c)


@slow
@pytest.mark.anyio
async def test_hung_ray_child_is_caught_by_heartbeats(cluster) -> None:
    placement = Ray(num_cpus=0.5, heartbeat_interval=0.1, heartbeat_timeout=0.6)
    async with Supervisor([ChildSpec("h", Echo, placement=placement)], intensity=3) as sup:
        old = await sup.ref("h").call("pid")
        with pytest.raises(ActorDead):
            await sup.ref("h").call("block", 60, timeout=20)
        assert await sup.ref("h").call("pid", timeout=20) != old
        assert find(await sup.snapshot(), "h")["last_crash"]["kind"] == "heartbeat"


def _groups(state: str = "CREATED") -> list[dict[str, Any]]:
    """Ray's placement groups in ``state`` (from its control store)."""
    return [g for g in ray.util.placement_group_table().values() if g["state"] == state]


async def _gang_pids(sup: Supervisor, child: str) -> list[list[int]]:
    """Every member's pid as each member gathered them over the gang's torch world."""
    ref = sup.ref(child)
    return list(
        await asyncio.gather(
            ref.call("gather_pids", timeout=60), ref.rank(1).call("gather_pids", timeout=60)
        )
    )


async def _members(sup: Supervisor, child: str) -> list[dict[str, Any]]:
    return find(await sup.snapshot(), child)["stats"]["members"]


@slow
@pytest.mark.anyio
async def test_a_ray_child_s_log_lines_reach_the_run_s_log_folder(cluster, tmp_path: Path) -> None:
    """A Ray node need not share the head's file system: the child logs into a folder on its
    node, and its lines are relayed to the run's folder — its last ones after it died too."""
    logs = (tmp_path / "logs").resolve()
    # No CPU of node-b's one: the gang tests after it need all of it, and a launcher may
    # outlive its child by a moment.
    placement = Ray(num_cpus=0, resources={"node-b": 0.01})
    with log_files(logs):
        async with Supervisor([ChildSpec("talker", Echo, placement=placement)]) as sup:
            ref = sup.ref("talker")
            node_folder = await ref.call("say", "hello")
            assert node_folder and Path(node_folder) != logs, node_folder

            await wait_until(
                lambda: _said(logs) == ["hello"], what="the line relayed to the run's folder"
            )
            await ref.cast("say_and_die", "bye")

            async def restarted_with_last_line() -> bool:
                entry = find(await sup.snapshot(), "talker")
                return entry["restart_count"] == 1 and _said(logs) == ["hello", "bye"]

            await wait_until(restarted_with_last_line, what="the dead child's last line relayed")
            assert not Path(node_folder).exists()  # its node folder went with the final pull
    assert _said(logs) == ["hello", "bye"]  # each line once: no pull repeated


def _said(logs: Path) -> list[str]:
    """The words the ``talker`` child logged, as the run's log folder has them."""
    path = logs / "talker.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e["word"] for e in lines if e["event"] == "said"]


@slow
@pytest.mark.timeout(360)  # torch-importing members start twice, beside CI's other worker
@pytest.mark.anyio
async def test_a_strict_pack_gang_is_one_placement_group_and_restarts_as_a_unit(cluster) -> None:
    # node-b has 1 CPU: both members (0.5 each) fit there, and only together.
    # Two minutes a start: the members import torch and meet, beside CI's other test worker.
    placement = Ray(num_cpus=0.5, resources={"node-b": 0.1}, start_timeout=120)
    spec = ChildSpec("pack", GangWorld, placement=placement, gang=2)
    async with Supervisor([spec], intensity=3) as sup:
        ref = sup.ref("pack")
        members = await _members(sup, "pack")
        assert [m["node_id"] for m in members] == [cluster.node_b.node_id] * 2
        old = find(await sup.snapshot(), "pack")["pids"]
        assert await _gang_pids(sup, "pack") == [old, old]  # one world, both ranks in it
        envs = [await ref.call("env"), await ref.rank(1).call("env")]
        assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1")]
        assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == {
            ("2", "2", "127.0.0.1")
        }
        [group] = _groups()
        assert group["strategy"] == "STRICT_PACK" and len(group["bundles"]) == 2, group
        # Named after the run (this process's namespace) and the child: `relax down` finds them.
        namespace = ray.get_runtime_context().namespace
        assert group["name"].startswith(f"relax:{namespace}:pack:"), group
        names = sorted(n for n in ray.util.list_named_actors() if n.startswith("relax:pack:"))
        assert [n.rsplit(":", 1)[0] for n in names] == ["relax:pack:0", "relax:pack:1"], names

        os.kill(old[1], signal.SIGKILL)

        async def both_new() -> bool:
            entry = find(await sup.snapshot(), "pack")
            return entry["state"] == "running" and not set(entry["pids"]) & set(old)

        await wait_until(both_new, timeout=120, what="both gang members restarted")
        await wait_until(lambda: not pid_alive(old[0]), what="the surviving member killed")
        entry = find(await sup.snapshot(), "pack")
        crash = entry["last_crash"]
        assert crash["member"] == 1 and crash["signal"] == "SIGKILL", crash
        assert entry["restart_count"] == 1
        new = entry["pids"]
        assert await _gang_pids(sup, "pack") == [new, new]  # a new world, both in it
        # The restart placed a new group; the old one was removed with the old start.
        [regroup] = _groups()
        assert regroup["placement_group_id"] != group["placement_group_id"]
        assert group["placement_group_id"] in {g["placement_group_id"] for g in _groups("REMOVED")}
    await wait_until(lambda: not _groups(), what="the gang's placement group removed at stop")
    assert not any(pid_alive(p) for p in new)


@slow
@pytest.mark.timeout(360)  # torch-importing members start twice, beside CI's other worker
@pytest.mark.anyio
async def test_a_strict_spread_gang_meets_across_nodes_through_relayed_rendezvous(
    cluster,
) -> None:
    placement = Ray(num_cpus=0.5, strategy="STRICT_SPREAD", start_timeout=120)
    spec = ChildSpec("spread", GangWorld, placement=placement, gang=2)
    async with Supervisor([spec], intensity=3) as sup:
        ref = sup.ref("spread")
        nodes = [m["node_id"] for m in await _members(sup, "spread")]
        assert len(set(nodes)) == 2 and cluster.node_b.node_id in nodes
        pids = find(await sup.snapshot(), "spread")["pids"]
        assert await _gang_pids(sup, "spread") == [pids, pids]
        envs = [await ref.call("env"), await ref.rank(1).call("env")]
        # Each member is alone on its node, with a rendezvous folder of its own there, which
        # its launcher filled with the port rank 0's store bound on rank 0's node.
        assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "1")] * 2
        folders = [e["RELAX_GANG_RENDEZVOUS"] for e in envs]
        assert folders[0] != folders[1] and all(folders)
        [group] = _groups()
        assert group["strategy"] == "STRICT_SPREAD"
    assert not any(Path(f).exists() for f in folders)  # the launchers removed them


@slow
@pytest.mark.timeout(360)  # torch-importing members start twice, beside CI's other worker
@pytest.mark.anyio
async def test_a_gang_no_node_can_hold_together_waits_until_one_joins(cluster) -> None:
    # Three members of one CPU each: the cluster has 3 CPUs, but no node holds 3.
    placement = Ray(num_cpus=1, start_timeout=120)
    spec = ChildSpec("big", GangWorld, placement=placement, gang=3)
    assert Ray(num_cpus=1, strategy="SPREAD").hostable(3) and not placement.hostable(3)
    async with Supervisor([spec], intensity=0) as sup:
        entry = find(await sup.snapshot(), "big")
        assert entry["state"] == "waiting", entry
        assert "cannot hold 3 members" in entry["waiting"] and "STRICT_PACK" in entry["waiting"]
        assert not _groups("PENDING")  # nothing left queued in Ray meanwhile
        big = add_node(cluster, num_cpus=3)
        try:

            async def running() -> list[dict[str, Any]] | None:
                entry = find(await sup.snapshot(), "big")
                return entry["stats"]["members"] if entry["state"] == "running" else None

            members = await wait_until(running, timeout=60, what="the gang placed on the new node")
            assert [m["node_id"] for m in members] == [big.node_id] * 3
            assert (await sup.snapshot())["restarts_in_period"] == 0
        finally:
            await sup.terminate_child("big")
            cluster.remove_node(big)


@slow
@pytest.mark.anyio
async def test_a_child_pinned_to_a_node_survives_that_node_s_loss(cluster) -> None:
    """Runs last: it removes node-b, and adds another node with the same resource."""
    node_b_id = cluster.node_b.node_id
    placement = Ray(num_cpus=0.5, resources={"node-b": 0.1}, start_timeout=60)
    async with Supervisor([ChildSpec("pinned", Echo, placement=placement)], intensity=3) as sup:
        old = await sup.ref("pinned").call("pid")
        assert find(await sup.snapshot(), "pinned")["stats"]["node_id"] == node_b_id
        pending = asyncio.create_task(sup.ref("pinned").call("sleep", 60, timeout=60))

        async def in_flight() -> bool:
            return find(await sup.snapshot(), "pinned")["stats"]["pending_calls"] == 1

        await wait_until(in_flight, what="the call to be in flight")
        cluster.remove_node(cluster.node_b)
        with pytest.raises(ActorDead):  # the call in flight fails at once, it does not hang
            await pending

        async def lost() -> dict[str, Any] | None:
            return find(await sup.snapshot(), "pinned")["last_crash"]

        crash = await wait_until(lost, timeout=30, what="the node loss to reach the supervisor")
        assert crash["kind"] == "node_lost", crash
        # Its child goes with its launcher (PR_SET_PDEATHSIG), which the raylet's end takes:
        # the verdict can reach the supervisor first, on a loaded machine.
        await wait_until(lambda: not pid_alive(old), timeout=30, what="the lost node's child gone")

        # No node has node-b now: the restart waits for one, shown as waiting, not counted.
        async def waiting() -> dict[str, Any] | None:
            entry = find(await sup.snapshot(), "pinned")
            return entry if entry["state"] == "waiting" else None

        entry = await wait_until(waiting, timeout=30, what="the child to wait for node-b")
        assert "node-b" in entry["waiting"], entry
        assert (await sup.snapshot())["restarts_in_period"] == 1  # the node loss, only
        cluster.node_b = add_node(cluster, num_cpus=1, resources={"node-b": 1})
        await wait_until(
            lambda: _answers_from_a_new_pid(sup, "pinned", old), timeout=60, what="a restart"
        )
        entry = find(await sup.snapshot(), "pinned")
        assert entry["stats"]["node_id"] == cluster.node_b.node_id != node_b_id
        assert entry["restart_count"] == 1


# --------------------------------------------------------------------------- config, preflight


def _cfg(text: str) -> Any:
    return parse_config("[model.init]\n" + text, source="cluster.toml")


def test_ray_placement_passes_the_preflight_when_ray_is_installed() -> None:
    _require_ray()
    cfg = _cfg('[rollout]\nplacement = "ray"\n[rollout.ray]\nresources = { "node-b" = 0.5 }\n')
    assert preflight(cfg) == []
    assert cfg.bus_transport == "tcp" and cfg.cluster.ray.address == "local"


def test_without_ray_the_preflight_names_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    issues = preflight(_cfg('[rollout]\nplacement = "ray"\n'))
    assert [(i.path, i.hint) for i in issues] == [("rollout.placement", 'pip install -e ".[ray]"')]


def test_a_gang_on_ray_passes_the_preflight_unless_its_bundle_is_empty() -> None:
    _require_ray()
    gang = '[trainer]\nbackend = "deepspeed"\nplacement = "ray"\ngang = 2\n[trainer.ray]\n'
    cfg = _cfg(gang + 'strategy = "SPREAD"\n')
    assert preflight(cfg) == [] and cfg.trainer.ray.strategy == "SPREAD"
    with pytest.raises(ConfigError) as info:
        _cfg(gang + "num_cpus = 0\n")
    assert "trainer.ray.num_cpus" in str(info.value) and "bundle" in str(info.value)
    with pytest.raises(ValueError, match="bundle cannot be empty"):
        ChildSpec("g", Echo, placement=Ray(num_cpus=0), gang=2)
    ChildSpec("g", Echo, placement=Ray(num_cpus=0), gang=1)  # a single member may ask nothing


def test_how_many_members_the_live_nodes_hold_follows_the_strategy(monkeypatch) -> None:
    _require_ray()

    def node(cpus: float, alive: bool = True, **extra: float) -> dict[str, Any]:
        return {"Alive": alive, "NodeID": "n", "Resources": {"CPU": cpus, **extra}}

    nodes = [node(2), node(1, gpu_pool=1.0), node(8, alive=False)]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)

    def holds(strategy: str, gang: int, **kw: Any) -> bool:
        return Ray(strategy=strategy, **kw).hostable(gang)  # type: ignore[arg-type]

    assert holds("STRICT_PACK", 2, num_cpus=1) and not holds("STRICT_PACK", 3, num_cpus=1)
    assert holds("PACK", 3, num_cpus=1) and not holds("SPREAD", 4, num_cpus=1)  # dead node
    assert holds("STRICT_SPREAD", 2, num_cpus=1) and not holds("STRICT_SPREAD", 3, num_cpus=0.1)
    assert holds("STRICT_PACK", 10, num_cpus=0.2)  # 2 / 0.2 is 10 members, not 9.999
    assert not holds("STRICT_PACK", 2, num_cpus=0.5, resources={"gpu_pool": 1})
    assert holds("SPREAD", 1, num_cpus=0.5, resources={"gpu_pool": 1})


def test_ray_options_become_the_placement(tmp_path: Path) -> None:
    from relax.cluster import _placement

    cfg = _cfg(
        '[reward]\nplacement = "ray"\nthreads = 2\n'
        '[reward.ray]\nnum_cpus = 0.5\nnum_gpus = 0.25\nresources = { "node-b" = 1 }\n'
        "start_timeout = 9\n"
    )
    placement = _placement(cfg.reward)
    assert isinstance(placement, Ray) and placement.kind == "ray"
    assert placement.demand() == {"num_cpus": 0.5, "num_gpus": 0.25, "resources": {"node-b": 1.0}}
    assert placement.start_timeout == 9 and placement.env["OMP_NUM_THREADS"] == "2"
    assert placement.transport == "tcp"
    assert placement.host == "127.0.0.1"  # the default [cluster] host: loopback
    # Off loopback (a head whose other nodes dial it), the children dial [cluster] host; that
    # needs the cluster secret, like every other endpoint bound there (no traffic is sent).
    exposed = _cfg(
        '[cluster]\nhost = "10.1.2.3"\nsecret_env = "RELAX_TEST_SECRET"\n'
        '[reward]\nplacement = "ray"\n'
    )
    assert _placement(exposed.reward, exposed.cluster.host).host == "10.1.2.3"
    with pytest.raises(ConfigError, match=r"cluster\.host"):
        _cfg('[cluster]\nhost = "10.1.2.3"\n[reward]\nplacement = "ray"\n')


def test_a_child_on_another_machine_is_refused_when_the_supervisor_listens_on_loopback() -> None:
    """A child placed on another machine's node cannot dial 127.0.0.1 back: its start fails at
    once naming cluster.host, instead of after a dial timeout."""
    from relax.actors._ray import unreachable_supervisor

    refused = unreachable_supervisor("127.0.0.1", "10.0.0.7")
    assert refused is not None and "cluster.host" in refused and "10.0.0.7" in refused
    assert unreachable_supervisor("localhost", "192.168.1.2") is not None
    assert unreachable_supervisor("127.0.0.1", "127.0.0.1") is None  # a node on this machine
    assert unreachable_supervisor("10.0.0.5", "10.0.0.7") is None  # the head's cluster address
    assert unreachable_supervisor("127.0.0.1", "") is None  # Ray did not say: let it dial


def test_a_child_started_at_ray_s_nice_value_gets_the_node_s_back() -> None:
    """On a cluster whose raylets run workers at Ray's nice 15, the launcher gives itself and
    its child the raylet's (its parent's) priority back where the OS allows it (as root)."""
    import subprocess
    import sys

    from relax.actors._ray_node import _node_priority

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        preexec_fn=lambda: os.nice(15),
    )
    try:
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 15 + os.nice(0)
        nice = _node_priority(child.pid)
        assert nice == os.getpriority(os.PRIO_PROCESS, child.pid)
        if os.geteuid() == 0:  # CI runs as root: the priority is lowered, not only reported
            assert nice == os.getpriority(os.PRIO_PROCESS, os.getppid())
    finally:
        child.kill()
        child.wait()


@pytest.mark.anyio
async def test_a_gang_leader_asked_for_its_port_before_its_spawn_waits_for_it(
    tmp_path: Path,
) -> None:
    """Rank 1's launcher may ask rank 0's for the store's port before the supervisor's
    ``spawn`` reached rank 0 (Ray orders no calls across callers): the answer waits for the
    spawn instead of failing (which left rank 1 without a port until its start timed out)."""
    import sys

    from relax.actors._ray_node import _Launcher
    from relax.runfiles import GANG_PORT_FILE

    leader = _Launcher()
    asked = asyncio.create_task(leader.announced_port())
    await asyncio.sleep(0)  # one turn: the question runs up to its first wait, before spawn
    assert not asked.done()  # (the old code failed right there, the relay dying with it)
    # What ``spawn`` does for a gang's rank 0: its folder, its child (which announces the
    # port its store bound), then it is spawned.
    leader._folder = str(tmp_path)
    port_file = tmp_path / GANG_PORT_FILE
    leader._proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", f"open({str(port_file)!r}, 'w').write('4321'); input()",
        stdin=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        leader._spawned.set()
        assert await asyncio.wait_for(asked, 30) == 4321
    finally:
        leader._proc.kill()
        await leader._proc.wait()


def _raise_system_exit() -> None:
    raise SystemExit(3)


@slow
def test_a_loop_torn_down_under_the_tree_still_stops_its_ray_child(cluster) -> None:
    # As the process case in tests/actors/test_faults.py: a SystemExit raised by a callback
    # escapes asyncio.run, which then cancels every task at once, the Ray member's watcher
    # with the teardown that waits on it. The child must still be asked to stop, not hang.
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with Supervisor([ChildSpec("r", Echo, placement=Ray(num_cpus=0.5))]) as sup:
            seen["pid"], seen["sup"] = await sup.ref("r").call("pid"), sup
            asyncio.get_running_loop().call_soon(_raise_system_exit)
            await sup.wait()

    with pytest.raises(SystemExit):
        asyncio.run(main())
    child = seen["sup"]._by_id["r"]
    assert child.last_exit is not None and child.last_exit.kind == "shutdown"
    assert child.last_exit.signal is None  # asked to stop, not killed
    assert not pid_alive(seen["pid"])
