"""relax.algos sits on a low floor: its modules import only torch, the stdlib and each other."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import relax.algos

ALGOS_DIR = Path(relax.algos.__file__).parent


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module)
    return roots


def test_algos_import_only_torch_stdlib_and_themselves() -> None:
    for path in sorted(ALGOS_DIR.glob("*.py")):
        for name in _imported_roots(path):
            top = name.split(".")[0]
            ok = (
                top == "torch"
                or top in sys.stdlib_module_names
                or name == "relax.algos"
                or name.startswith("relax.algos.")
            )
            assert ok, f"{path.name} imports {name}"


def test_public_namespace_is_curated() -> None:
    public = set(relax.algos.__all__)
    assert all(not name.startswith("_") for name in public)
    assert all(hasattr(relax.algos, name) for name in public)
    for name in ("grpo_advantages", "ppo_loss", "gspo_loss", "cispo_loss", "tis_weights"):
        assert callable(getattr(relax.algos, name))
