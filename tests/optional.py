"""Tests of an optional extra (ray, vllm): skipped where it is not installed, but failed where
an environment variable (``RELAX_REQUIRE_RAY=1`` in CI) says it must be."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require(module: str, env_var: str, hint: str, *, whole_module: bool = False) -> None:
    """Skip (the test, or with ``whole_module`` the calling module) when ``module`` cannot be
    found; raise instead when ``env_var`` is ``1``. Found, not imported: collection stays fast."""
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get(env_var) == "1":
        raise ImportError(f"{env_var}=1 but {module} is not installed: {hint}")
    pytest.skip(f"{module} is not installed: {hint}", allow_module_level=whole_module)
