"""The trainer's per-step batch metrics computed from the rows themselves."""

from __future__ import annotations

import pytest
import torch

from relax.roles._trainer import lag_histogram, length_metrics, token_version_metrics
from relax.schema import RESPONSE_IDS, TOKEN_VERSIONS


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
