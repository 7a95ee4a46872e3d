"""The weights commit is one logged decision: a bus killed at any point of it neither loses the
step's rows nor exposes weights whose rows' ack it did not log, and the trainer's publish
finishes across the restart.

The first tests drive ``WeightStore`` and ``BusTable`` directly, leaving on disk and in the log
exactly what a SIGKILL at each point leaves. The last one runs the bus in its own process,
makes it SIGKILL itself at each point (``RELAX_BUS_KILL_AT``) and lets a real client publish
through the restart under a supervisor allowing one restart in five seconds.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from relax.actors import ChildSpec, Process, Supervisor
from relax.bus import BusClient, BusService, BusTable, SegmentLog, WeightStore
from relax.bus._service import KILL_AT_ENV
from relax.errors import BusError, UploadLost
from relax.transport import loads
from tests.actors.helpers import find

pytestmark = pytest.mark.anyio

STATE = {f"layer{i}.weight": torch.full((32, 32), float(i)) for i in range(4)}


def sealed(store: WeightStore, version: int) -> dict:
    store.begin(version, {"buckets": 1, "names": list(STATE)})
    store.put_bucket(version, 0, dict(STATE))
    return store.seal(version)


def restarted(directory, committed: int) -> WeightStore:
    store = WeightStore(directory)
    store.recover(committed)
    return store


def test_a_kill_before_or_during_the_upload_leaves_nothing_and_the_retry_hears_upload_lost(
    tmp_path,
) -> None:
    store = WeightStore(tmp_path)
    store.begin(1, {"buckets": 2, "names": list(STATE)})
    store.put_bucket(1, 0, dict(STATE))
    again = restarted(tmp_path, committed=-1)
    assert again.current == -1 and not list(tmp_path.iterdir())
    with pytest.raises(UploadLost):
        again.put_bucket(1, 1, {})
    with pytest.raises(UploadLost):
        again.seal(1)


@pytest.mark.parametrize("version, committed", [(0, -1), (3, 2)])
def test_a_staged_file_the_log_does_not_know_is_deleted_never_served(
    tmp_path, version, committed
) -> None:
    store = WeightStore(tmp_path)
    store.stage(version, sealed(store, version))
    assert store.current == -1  # staged is not visible, even before a restart
    again = restarted(tmp_path, committed=committed)  # killed before the commit record
    assert again.current == -1 and not list(tmp_path.iterdir())


def test_final_files_of_a_log_from_before_commit_records_are_kept(tmp_path) -> None:
    store = WeightStore(tmp_path)
    entry = sealed(store, 4)
    store.stage(4, entry)
    store.promote(4, entry)
    again = WeightStore(tmp_path)
    again.recover(-1, trust_final=True)  # such a log knows its weights by their files
    assert again.current == 4


def test_a_staged_file_the_log_committed_is_promoted_and_served(tmp_path) -> None:
    store = WeightStore(tmp_path)
    store.stage(1, sealed(store, 1))  # the record is logged, the bus dies before the rename
    again = restarted(tmp_path, committed=1)
    assert again.current == 1
    got = again.get_bucket(1, 0)["tensors"]  # wire form, read without torch
    assert all(torch.equal(got[k].to_torch(), STATE[k]) for k in STATE)
    # The file is a safetensors file, which safetensors reads the same.
    with safe_open(str(tmp_path / "v000000000001.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(f"0/{k}"), STATE[k]) for k in STATE)
    assert [p.name for p in tmp_path.iterdir()] == ["v000000000001.safetensors"]


def test_final_files_above_the_logged_version_and_torn_writes_are_deleted(tmp_path) -> None:
    store = WeightStore(tmp_path)
    for version in (1, 2):
        entry = sealed(store, version)
        store.stage(version, entry)
        store.promote(version, entry)
    (tmp_path / ".v3.tmp").write_bytes(b"torn")
    again = restarted(tmp_path, committed=1)  # the log lost v2's record (a machine crash)
    assert again.current == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000000000001.safetensors"]


def test_discard_removes_a_staged_file_whose_commit_failed(tmp_path) -> None:
    store = WeightStore(tmp_path)
    store.stage(1, sealed(store, 1))
    store.discard(1)
    assert not list(tmp_path.iterdir())


def test_the_commit_op_acks_moves_the_version_and_drops_stale_rows_in_one_record() -> None:
    table = BusTable(tasks=("train",), staleness=0, batch_size=2)
    table.put([{"uid": f"a{i}", "group": "a", "group_size": 2, "version": 0} for i in range(2)])
    table.put([{"uid": f"b{i}", "group": "b", "group_size": 2, "version": 0} for i in range(2)])
    log = list(table.put([{"uid": "c0", "group": "c", "version": 0}]) or [])
    ops, lease = table.take(
        "train", batch_size=2, min_rows=2, whole_groups=True, holder="t", lease_timeout=60, now=0
    )
    assert lease is not None
    ops = table.commit_weights(1, "p1", task="train", items=[tuple(i) for i in lease.items.items()])
    assert len(ops) == 1 and ops[0]["op"] == "commit"
    assert table.trained == 2 and table.version == 1 and table.weights_version == 1
    assert ops[0]["drop"] is not None  # b and c were generated by v0: too stale for s=0 at v1
    assert not table.rows
    # Replayed (from the beginning, or from a compaction snapshot), it is the same decision.
    replay = BusTable(tasks=("train",), staleness=0, batch_size=2)
    for seq, op in enumerate(log + ops):
        replay.apply(op, seq)
    assert replay.publishes == {1: "p1"} and replay.weights_version == 1
    snapshot = BusTable(tasks=("train",), staleness=0, batch_size=2)
    snapshot.apply(table.state_op())
    assert snapshot.publishes == {1: "p1"} and snapshot.weights_version == 1
    with pytest.raises(BusError, match="not newer"):
        table.commit_weights(1, "p2")


POINTS = ["before_upload", "mid_upload", "after_weights_file", "after_commit_record"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", POINTS)
async def test_a_bus_sigkilled_at_each_point_of_the_commit_finishes_the_publish_once(
    tmp_path, point
) -> None:
    url = f"ipc://{tmp_path}/bus.sock"
    kwargs = {"url": url, "run_dir": str(tmp_path), "tasks": ["train"], "staleness": "inf"}
    spec = ChildSpec("bus", BusService, kwargs=kwargs, placement=Process(env={KILL_AT_ENV: point}))
    rows = [{"uid": f"g/{i}", "group": "g", "group_size": 4, "version": 0} for i in range(4)]
    async with (
        Supervisor([spec], intensity=1, period=5) as sup,  # the recipes' defaults
        await BusClient.connect(url, connect_timeout=60) as bus,
    ):
        await bus.put(rows)
        async with bus.take("train", batch_size=4, min_rows=4) as batch:
            # 3 buckets: "mid_upload" lands after the first one.
            await bus.publish_weights(1, STATE, bucket_bytes=8 << 10, ack=batch)
        assert (tmp_path / f"killed-at-{point}").exists()  # the kill happened, where asked
        assert find(await sup.snapshot(), "bus")["restart_count"] == 1
        stats = await bus.statistics()
        assert stats["trainer_version"] == 1 and stats["counters"]["trained"] == 4, stats
        assert stats["counters"].get("ignored_acks", 0) == 0 and stats["rows"] == 0
        version, got = await bus.poll_weights(wait=0)
        assert version == 1 and all(torch.equal(got[k], STATE[k]) for k in STATE)
        await bus.publish_weights(2, STATE)  # and the next one goes through as usual
    with SegmentLog(tmp_path / "bus-log") as log:
        ops = [loads(record) for _, record in log.replay()]
    commits = [op for op in ops if op["op"] == "commit"]
    assert [c["version"] for c in commits] == [1, 2]  # one record per commit, none twice
    assert sorted(u for u, _ in commits[0]["items"]) == [r["uid"] for r in rows]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "v000000000001.safetensors",
        "v000000000002.safetensors",
    ]
