"""relax.training sits below the actors: it imports only its allowed libraries and floors."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import relax.training

TRAINING_DIR = Path(relax.training.__file__).parent
ALLOWED_LIBS = {"torch", "transformers", "safetensors", "deepspeed"}
ALLOWED_RELAX = (
    "relax.algos",
    "relax.errors",
    "relax.schema",  # standard library only: the column names rows are read by
    "relax.transport",  # the gang's torch.distributed world and the bytes its ranks exchange
    "relax.config",
    "relax.training",
    # Below this floor; training needs exactly what generation does with media (how a batch's
    # media collate, which ids the sampler never draws), so both use this same code.
    "relax.models",
)


def test_training_imports_stay_on_their_floor() -> None:
    for path in sorted(TRAINING_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                ok = (
                    top in ALLOWED_LIBS
                    or top in sys.stdlib_module_names
                    or name.startswith(ALLOWED_RELAX)
                )
                assert ok, f"{path.name} imports {name}"


def test_public_namespace_is_curated() -> None:
    assert all(hasattr(relax.training, name) for name in relax.training.__all__)
