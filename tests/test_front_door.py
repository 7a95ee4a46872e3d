"""The package's front door: ``relax.up``, ``relax.embed``, ``relax.load_config``,
``relax.ClusterConfig``, ``relax.RelaxError`` and ``__version__``, each imported when first used
(``import relax`` must stay cheap: ``import relax.config`` runs it first)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import relax

ROOT = Path(__file__).resolve().parents[1]


def test_import_relax_loads_neither_torch_nor_the_cluster() -> None:
    code = (
        "import sys, relax\n"
        "heavy = [m for m in ('torch', 'transformers', 'relax.cluster', 'relax.config')"
        " if m in sys.modules]\n"
        "relax.RelaxError, relax.ClusterConfig, relax.load_config\n"
        "print(heavy, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.split() == ["[]", "False"]  # nothing heavy, not even once the config is used


def test_each_name_is_the_existing_object() -> None:
    import relax.cluster
    import relax.config
    import relax.errors

    assert relax.up is relax.cluster.run
    assert relax.load_config is relax.config.load_config
    assert relax.ClusterConfig is relax.config.ClusterConfig
    assert relax.RelaxError is relax.errors.RelaxError
    assert relax.embed is sys.modules["relax.embed"]  # the module, not a function named embed
    assert callable(relax.embed.start)
    assert set(relax.__all__) <= set(dir(relax))
    assert relax.__version__ == importlib.metadata.version("relax-rl")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        relax.nope  # noqa: B018
    from relax import cluster  # a submodule not in the front door still imports as one

    assert cluster.run is relax.up
