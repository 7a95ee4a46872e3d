"""The finished-uid journal under a kill: a bus SIGKILLed after a compaction's log records and
before its journal delta (``RELAX_BUS_KILL_AT=before_journal``) forgets no finished uid."""

from __future__ import annotations

import pytest
import torch

from relax.actors import ChildSpec, Process, Supervisor
from relax.bus import BusClient, BusService
from relax.bus._service import KILL_AT_ENV
from tests.actors.helpers import find

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def group(i: int) -> list[dict]:
    uid = f"g{i}"
    blob = torch.full((64,), float(i))  # fills segments: compaction has segments to delete
    return [
        {"uid": f"{uid}/0", "group": uid, "group_size": 1, "version": 0, "columns": {"blob": blob}}
    ]


@pytest.mark.timeout(120)
async def test_a_bus_killed_before_its_journal_delta_forgets_no_finished_uid(tmp_path) -> None:
    url = f"ipc://{tmp_path}/bus.sock"
    kwargs = {
        "url": url,
        "run_dir": str(tmp_path),
        "tasks": ["train"],
        "staleness": "inf",
        "segment_bytes": 4096,
        "compact_every": 40,
    }
    env = {KILL_AT_ENV: "before_journal"}
    spec = ChildSpec("bus", BusService, kwargs=kwargs, placement=Process(env=env))
    taken: list[str] = []  # the consumer's own evidence: every uid it was given
    async with (
        Supervisor([spec], intensity=1, period=5) as sup,
        await BusClient.connect(url, connect_timeout=60) as bus,
    ):
        for i in range(120):
            await bus.put(group(i))
            async with bus.take("train", batch_size=1, min_rows=1) as batch:
                taken += [r["uid"] for r in batch.rows]
        assert (tmp_path / "killed-at-before_journal").exists()
        assert find(await sup.snapshot(), "bus")["restart_count"] == 1
        # Every uid again, as a producer retrying after a crash would: all are remembered,
        # those finished before the kill's compaction included.
        again = await bus.put([row for i in range(120) for row in group(i)])
        stats = await bus.statistics()
    assert sorted(taken) == sorted(f"g{i}/0" for i in range(120))  # each given out once
    assert again == 0 and stats["rows"] == 0
    assert stats["counters"]["trained"] == 120
    assert stats["log"]["first_seq"] > 0  # compactions after the restart deleted segments
