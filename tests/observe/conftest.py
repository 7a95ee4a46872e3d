"""Fixtures of the observability tests."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

from tests.observe.helpers import FakeRun


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module in ``sys.modules``: no network, records every call."""
    module = types.ModuleType("wandb")
    module.runs = []  # type: ignore[attr-defined]

    def init(**kwargs: Any) -> FakeRun:
        run = FakeRun(**kwargs)
        module.runs.append(run)  # type: ignore[attr-defined]
        return run

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


@pytest.fixture
def json_logs(monkeypatch):
    """Debug-level JSON logging into a buffer for this test (child processes inherit the level
    and format); the previous configuration comes back afterwards."""
    import io

    import structlog

    from relax.log import ENV_FORMAT, ENV_LEVEL, ENV_LOG_DIR, configure_logging

    before = {name: os.environ.get(name) for name in (ENV_LEVEL, ENV_FORMAT)}
    monkeypatch.delenv(ENV_LOG_DIR, raising=False)
    stream = io.StringIO()
    configure_logging(level="debug", fmt="json", stream=stream, force=True)
    yield stream
    for name, value in before.items():  # configure as before this test, not at debug level
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    structlog.reset_defaults()
    configure_logging(force=True)
