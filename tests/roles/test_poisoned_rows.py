"""A role that meets a poisoned row drops it (and its group) with a counted reason and goes on.

Today's bus refuses such rows at the put, so the tests plant them the way an older bus would
have left them: as put records in the bus log, which the bus replays when it starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relax.actors import ChildSpec, InProc
from relax.bus import BusClient, SegmentLog
from relax.roles._common import BAD_COLUMNS
from relax.roles._critic import CriticRole
from relax.roles._reference import ReferenceRole
from relax.roles._reward import RewardRole
from relax.roles._rollout import RolloutRole
from relax.transport import dumps
from tests.polling import wait_until
from tests.roles.helpers import (
    bus_spec,
    config,
    one_step_trainer,
    prompts_spec,
    sample_rows,
    start,
    tiny_model,
)

pytestmark = pytest.mark.anyio


def plant(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Rows in the bus log as an older bus (which checked no column) would have written them."""
    log = SegmentLog(run_dir / "bus-log")
    log.append_many([dumps({"op": "put", "rows": rows})])
    log.close()


def restarts(snapshot: dict[str, Any], child: str) -> int:
    return next(c for c in snapshot["children"] if c["id"] == child)["restart_count"]


async def test_the_reward_role_drops_a_row_with_string_response_ids(tmp_path: Path) -> None:
    rows = sample_rows(4, answer="4")
    rows[-1]["columns"]["response_ids"] = [7]  # sample_rows leaves the last one empty
    rows[2]["columns"]["response_ids"] = "the answer is 4"  # group g1 is poisoned
    rows[2]["columns"]["logprobs"] = [-1.0]
    plant(tmp_path / "samples", rows)
    bus, url = bus_spec(["reward", "train"], tmp_path)
    role = ChildSpec(
        "reward-0",
        RewardRole,
        kwargs={"config": config(), "samples_url": url, "model_dir": str(tiny_model(tmp_path))},
        placement=InProc(),
    )
    sup = await start([bus, role])
    try:
        async with await BusClient.connect(url) as client:

            async def rewarded() -> Any:
                batch = await client.take_batch("train", batch_size=8, columns=["reward"], wait=1)
                if batch.rows:
                    await client.ack(batch)
                return batch.rows

            got = await wait_until(rewarded, 60.0, "rewards of the good group", interval=0.2)
            stats = await client.statistics()
        assert sorted(r["uid"] for r in got) == ["g0/0", "g0/1"]
        assert stats["counters"][f"dropped_{BAD_COLUMNS}"] == 2  # the poisoned group, counted
        assert restarts(await sup.snapshot(), "reward-0") == 0
    finally:
        await sup.__aexit__(None, None, None)


async def test_the_trainer_drops_a_group_whose_reward_is_not_a_number(tmp_path: Path) -> None:
    rows = sample_rows(6, reward=1.0)
    rows[-1]["columns"]["response_ids"] = [7]
    rows[-1]["columns"]["logprobs"] = [-1.0]
    rows[2]["columns"]["reward"] = "high"  # group g1, between two good groups
    plant(tmp_path / "samples", rows)
    bus, url = bus_spec(["train"], tmp_path)
    role = one_step_trainer(url, tmp_path)
    sup = await start([bus, role])
    try:
        async with await BusClient.connect(url) as client:

            async def trained() -> Any:
                stats = await client.statistics()
                return stats if stats["trainer_version"] >= 1 else None

            stats = await wait_until(trained, 60.0, "one training step", interval=0.2)
        assert stats["counters"][f"dropped_{BAD_COLUMNS}"] == 2
        assert stats["counters"]["trained"] == 4  # g0 and g2: the good groups were trained
        assert restarts(await sup.snapshot(), "trainer") == 0
    finally:
        await sup.__aexit__(None, None, None)


async def test_the_rollout_drops_a_prompt_whose_prompt_ids_are_text(tmp_path: Path) -> None:
    prompts_url = "inproc://poisoned-prompts"
    prompts = prompts_spec(
        prompts_url,
        tmp_path / "prompts",
        [
            {
                "uid": "p0",
                "group": "p0",
                "version": 0,
                "columns": {"prompt_ids": "2+2?", "answer": "4"},
            },
            {
                "uid": "p1",
                "group": "p1",
                "version": 0,
                "columns": {"prompt_ids": [5, 6, 7], "answer": "4"},
            },
        ],
    )
    samples, samples_url = bus_spec(["reward", "train"], tmp_path)
    role = ChildSpec(
        "rollout-0",
        RolloutRole,
        kwargs={
            "config": config("[rollout]\nmax_new_tokens = 3\n"),
            "prompts_url": prompts_url,
            "samples_url": samples_url,
            "model_dir": str(tiny_model(tmp_path)),
        },
        placement=InProc(),
    )
    sup = await start([prompts, samples, role])
    try:
        async with (
            await BusClient.connect(prompts_url) as prompt_bus,
            await BusClient.connect(samples_url) as sample_bus,
        ):

            async def generated() -> Any:
                stats = await sample_bus.statistics()
                return stats if stats["rows"] >= 2 else None

            await wait_until(generated, 60.0, "the good prompt's samples", interval=0.2)
            batch = await sample_bus.take_batch("reward", batch_size=8, wait=1)
            stats = await prompt_bus.statistics()
        assert sorted(r["uid"] for r in batch.rows) == ["p1/0", "p1/1"]
        assert stats["counters"][f"dropped_{BAD_COLUMNS}"] == 1
        assert restarts(await sup.snapshot(), "rollout-0") == 0
    finally:
        await sup.__aexit__(None, None, None)


def test_a_producer_leaves_out_a_group_the_bus_would_refuse() -> None:
    """An environment's NaN reward would get the rollout's whole put refused, and the retried
    prompt would fail the same way forever; the rollout leaves out that group instead."""
    import structlog

    from relax.bus._columns import check_rows
    from relax.roles._common import well_formed

    rows = sample_rows(6, reward=[0.5, 0.5, float("nan"), 0.5, 1.0, 1.0])
    rows[-1]["columns"]["response_ids"] = [7]
    rows[-1]["columns"]["logprobs"] = [-1.0]
    log = structlog.get_logger("test")
    with structlog.testing.capture_logs() as logs:
        kept = well_formed(rows, log)
    assert [r["group"] for r in kept] == ["g0", "g0", "g2", "g2"]
    check_rows(kept)  # the rest goes in
    assert [e["group"] for e in logs] == ["g1"] and "not finite" in logs[0]["problem"]


@pytest.mark.parametrize(
    ("task", "written", "poison"),
    [
        ("reference", "ref_logprobs", {"response_ids": "the answer is 4"}),
        ("critic", "values", {"reward": "high"}),
    ],
)
async def test_the_reference_and_the_critic_drop_a_poisoned_group(
    tmp_path: Path, task: str, written: str, poison: dict[str, Any]
) -> None:
    rows = sample_rows(6, reward=1.0)
    rows[-1]["columns"]["response_ids"] = [7]
    rows[-1]["columns"]["logprobs"] = [-1.0]
    rows[2]["columns"].update(poison)  # group g1, between two good groups
    plant(tmp_path / "samples", rows)
    bus, url = bus_spec([task, "train"], tmp_path)
    kwargs: dict[str, Any] = {
        "config": config(),
        "samples_url": url,
        "model_dir": str(tiny_model(tmp_path)),
    }
    if task == "critic":
        role_class, kwargs["run_dir"] = CriticRole, str(tmp_path / "run")
    else:
        role_class = ReferenceRole
    sup = await start([bus, ChildSpec(f"{task}-0", role_class, kwargs=kwargs, placement=InProc())])
    try:
        async with await BusClient.connect(url) as client:

            async def scored() -> Any:
                batch = await client.take_batch(
                    "train", batch_size=8, columns=[written], min_rows=4, wait=1
                )
                if batch.rows:
                    await client.ack(batch)
                return batch.rows

            got = await wait_until(scored, 60.0, f"{written} of the good groups", interval=0.2)
            stats = await client.statistics()
        assert sorted(r["uid"] for r in got) == ["g0/0", "g0/1", "g2/0", "g2/1"]
        assert stats["counters"][f"dropped_{BAD_COLUMNS}"] == 2  # the poisoned group, counted
        assert restarts(await sup.snapshot(), f"{task}-0") == 0
    finally:
        await sup.__aexit__(None, None, None)
