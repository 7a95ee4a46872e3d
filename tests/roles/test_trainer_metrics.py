"""The trainer's per-step metrics: batch metrics computed from the rows themselves, and how
long a step waited for its rows."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from relax.bus import BusClient
from relax.roles._trainer import (
    lag_histogram,
    length_metrics,
    token_version_metrics,
)
from relax.schema import RESPONSE_IDS, TOKEN_VERSIONS
from tests.polling import wait_until
from tests.roles.helpers import bus_spec, one_step_trainer, sample_rows, start


def row(version: int, tokens: int, versions: list[int] | None = None) -> dict:
    columns: dict = {RESPONSE_IDS: list(range(tokens))}
    if versions is not None:
        columns[TOKEN_VERSIONS] = torch.tensor(versions)  # as the bus may hand it over
    return {"version": version, "columns": columns}


def test_token_versions_give_the_resumed_share_and_the_token_lag() -> None:
    rows = [
        row(3, 4, [3, 3, 5, 5]),  # interrupted after two tokens: two tokens newer than the row
        row(4, 2, [4, 4]),
        row(5, 3),  # an engine that records no token versions: left out
    ]
    metrics = token_version_metrics(rows, trainer_version=6)
    assert metrics["resumed_token_share"] == pytest.approx(2 / 6)
    assert metrics["token_lag_mean"] == pytest.approx((3 + 3 + 1 + 1 + 2 + 2) / 6)
    assert lag_histogram(6, [r["version"] for r in rows]) == {"1": 1, "2": 1, "3": 1}
    assert token_version_metrics([row(5, 3)], trainer_version=6) == {}
    assert length_metrics(rows) == {"response_length_mean": 3.0, "response_length_max": 4}


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_steps_take_time_counts_every_take_that_came_back_empty(tmp_path: Path) -> None:
    # The trainer's takes wait 5 s each; rows arrive after one came back empty. take_time_s
    # counted only the last take (about 3 s here), hiding a wait of any length — a bus restart
    # that stranded a lease for 60 s showed as 4.9 s.
    bus, url = bus_spec(["train"], tmp_path)
    trainer = one_step_trainer(url, tmp_path)
    sup = await start([bus, trainer])
    try:
        async with await BusClient.connect(url) as client:
            started = time.monotonic()  # the trainer is running, its first take under way
            # The late rows this test is about: they come after the first take (5 s) came
            # back empty, however late the trainer began it (up to 2.5 s here).
            await asyncio.sleep(8.0)
            await client.put(sample_rows(4, reward=[1.0, 0.0, 1.0, 0.0]))
            arrived = time.monotonic() - started

            async def trained() -> bool:
                return (await client.statistics())["trainer_version"] >= 1

            await wait_until(trained, 60.0, "one training step", interval=0.2)
    finally:
        await sup.__aexit__(None, None, None)
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # Counting only the last take gives at most arrived - 5 s (here 3); counting from the
    # first gives arrived less the trainer's start-up before it (the 2.5 s allowed above).
    assert arrived - 2.5 <= step["take_time_s"] <= arrived + 5.0, (arrived, step["take_time_s"])
