"""Fixtures the engine tests share: two tiny weight sets of the shapes the module's ``TINY``
names (the engine contract runs on both engines, each with its own shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax.config import ModelInitConfig
from relax.models import build_tiny_model, load_policy


def _tiny_model(request: pytest.FixtureRequest, factory: pytest.TempPathFactory, seed: int) -> Path:
    init = ModelInitConfig(**request.module.TINY, seed=seed)
    return build_tiny_model(init, factory.mktemp(f"tiny{seed}"))


@pytest.fixture(scope="module")
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The version-0 weights."""
    return _tiny_model(request, tmp_path_factory, 0)


@pytest.fixture(scope="module")
def tiny_dir_other(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Same shapes, another seed: the "next version" of the weights."""
    return _tiny_model(request, tmp_path_factory, 1)


@pytest.fixture(scope="module")
def reference_models(tiny_dir: Path, tiny_dir_other: Path) -> dict[int, torch.nn.Module]:
    """Independent HF copies of the two weight sets, for recomputation (and HF generation)."""
    return {0: load_policy(tiny_dir)[0], 1: load_policy(tiny_dir_other)[0]}
