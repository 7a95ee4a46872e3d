"""Shared test setup: async tests run on asyncio through anyio's pytest plugin."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def events_file(tmp_path):
    """A file that actors (in this process or in children) append lifecycle events to."""
    return str(tmp_path / "events.log")
