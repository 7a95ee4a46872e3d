"""The tiny Qwen2.5-Omni thinker the multimodal tests share (engines, models, agents).

A test module uses the fixtures by importing them (pytest finds fixtures among a module's
names); they are registered under the names tests ask for (``omni_dir``, ``processor``):

    from tests.models.helpers import omni_dir_fixture, processor_fixture  # noqa: F401
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relax.config import ModelInitConfig
from relax.models import build_tiny_model, load_processor

OMNI = {
    "arch": "qwen2_5_omni",
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
}
"""``[model.init]`` of the tiny omni thinker of these tests (≈0.38 M parameters)."""


def build_omni(directory: str | Path, seed: int = 0) -> Path:
    """``build_tiny_model`` of ``OMNI`` with this seed, saved to ``directory``."""
    return build_tiny_model(ModelInitConfig(**OMNI, seed=seed), directory)


@pytest.fixture(scope="module", name="omni_dir")
def omni_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed-0 tiny omni checkpoint, built once per test module."""
    return build_omni(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module", name="processor")
def processor_fixture(omni_dir: Path) -> Any:
    """The processor saved with ``omni_dir``."""
    return load_processor(omni_dir)
