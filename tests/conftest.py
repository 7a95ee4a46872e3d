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


_PATCHED_WHILE_BUILDING = ("tie_weights", "init_weights")
"""What transformers swaps for no-ops on ``PreTrainedModel`` while it builds a model."""


@pytest.fixture(autouse=True)
def _transformers_left_intact():
    """Fail the test that leaves transformers' building patches in place (two threads building
    at once do), instead of every later test in the worker that loads a model."""
    import sys

    modeling = sys.modules.get("transformers.modeling_utils")
    before = (
        {n: getattr(modeling.PreTrainedModel, n) for n in _PATCHED_WHILE_BUILDING}
        if modeling
        else None
    )
    yield
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return
    cls = modeling.PreTrainedModel
    if before is None:  # imported during this test: the originals are named functions
        broken = [n for n in _PATCHED_WHILE_BUILDING if getattr(cls, n).__name__ != n]
    else:
        broken = [n for n in _PATCHED_WHILE_BUILDING if getattr(cls, n) is not before[n]]
        for name in broken:
            setattr(cls, name, before[name])
    if broken:
        pytest.fail(
            f"this test left PreTrainedModel.{', '.join(broken)} patched (a model built"
            " in two threads at once)"
        )


@pytest.fixture(autouse=True)
def _default_dtype_left_intact():
    """Fail the test that leaves torch's default dtype changed (process-wide: transformers
    sets it while it builds a model), instead of the later tests it would quietly move to
    another precision."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_default_dtype() if torch else None
    yield
    torch = sys.modules.get("torch")
    if torch is None:
        return
    now = torch.get_default_dtype()
    expected = before or torch.float32
    if now != expected:
        torch.set_default_dtype(expected)
        pytest.fail(f"this test left torch's default dtype at {now} (was {expected})")
