"""Every import inside ``relax/`` respects the floors docs/architecture.md draws: a module
imports only from its own floor or below (imports inside functions count too: a lazy import
upward is still a cycle waiting to happen). Each top-level module has a floor."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def floors() -> dict[str, int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    [line] = re.findall(r"^errors.*→ cli$", text, re.MULTILINE)
    return {
        name: level for level, group in enumerate(line.split(" → ")) for name in group.split(", ")
    }


def relax_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("relax.")]
    return found


def test_every_import_respects_the_floors() -> None:
    level = floors()
    packages = ROOT / "relax"
    tops = {p.name.removesuffix(".py") for p in packages.iterdir()} - {"__init__", "__pycache__"}
    tops = {t for t in tops if not t.startswith(".") and t != "py.typed"}
    assert tops - set(level) == set(), f"modules without a floor: {sorted(tops - set(level))}"
    upward = []
    for path in sorted(packages.rglob("*.py")):
        top = path.relative_to(packages).parts[0].removesuffix(".py")
        if top == "__init__":
            continue
        for line, name in relax_imports(path):
            if level[name.split(".")[1]] > level[top]:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not upward, "\n".join(upward)


def test_an_upward_import_would_be_caught(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from relax.actors._protocol import exit_from_wire\n")
    [(line, name)] = relax_imports(module)
    assert (line, name) == (2, "relax.actors._protocol")
    assert floors()[name.split(".")[1]] > floors()["errors"]
