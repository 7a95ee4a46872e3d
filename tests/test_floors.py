"""Every import inside ``relax/`` respects the floors docs/architecture.md draws: a module
imports only from its own floor or below (imports inside functions count too: a lazy import
upward is still a cycle waiting to happen). Each top-level module has a floor.

And no two files of ``relax/`` or ``cli/`` (installed as ``relax.cli``) import each other,
directly or through others, at any import site: module level, inside a function, or under
``if TYPE_CHECKING:``. Edges go to the module an import names: ``from relax.foo._bar import x``
is an edge to ``relax.foo._bar`` only (the package ``relax.foo`` runs first, but re-exporting
its private modules is what a package ``__init__`` is for), and ``from relax.foo import x`` is
an edge to the package ``relax.foo`` itself, unless ``x`` is one of its submodules. So a
private module that imports its own package back is a cycle."""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator
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


def module_files(sources: dict[str, Path]) -> dict[str, Path]:
    """Every module under each source folder, by its dotted name (``{"relax.cli": ROOT/"cli"}``
    names ``cli/_up.py`` ``relax.cli._up``); a package by its ``__init__.py``."""
    found = {}
    for prefix, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import site in ``path`` (module ``name``) of a module in
    ``known``; relative imports are resolved against ``name``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name  # ``import a.b.c``: the deepest of them that is ours
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target:
                    yield node.lineno, target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if base not in known:
                continue
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            yield from ((node.lineno, m) for m in submodules)
            if len(submodules) < len(node.names):  # a name defined in (or re-exported by) base
                yield node.lineno, base


def import_graph(sources: dict[str, Path]) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the modules of ``sources``."""
    files = module_files(sources)
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges = graph.setdefault(name, {})
        for line, target in imported_modules(name, path, set(files)):
            edges.setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each group of modules that import each other."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for root in sorted(graph):  # Tarjan's strongly connected components, without recursion
        if root in order:
            continue
        work = [(root, iter(sorted(graph[root])))]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1 or node in graph[node]:
                        groups.append(group)
            elif target not in order:
                order[target] = low[target] = len(order)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in on_stack:
                low[node] = min(low[node], order[target])
    return [_cycle_in(group, graph) for group in groups]


def _cycle_in(group: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest cycle through the first module of ``group`` (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node]):
            if target == start:
                return paths[node] + [start]
            if target in group and target not in paths:
                paths[target] = paths[node] + [target]
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group has one


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


SOURCES = {"relax": ROOT / "relax", "relax.cli": ROOT / "cli"}


def test_no_module_imports_itself_back() -> None:
    graph = import_graph(SOURCES)
    assert "relax.cli._up" in graph and "relax.actors._supervisor" in graph
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c, graph) for c in cycles)


def test_a_cycle_would_be_caught(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    # A package re-exporting its private modules, which import each other downward: no cycle.
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub._a import A\nfrom . import _b\n")
    (pkg / "sub" / "_a.py").write_text("from pkg.sub._b import B\n")
    (pkg / "sub" / "_b.py").write_text("B = 1\n")
    (pkg / "user.py").write_text("from pkg.sub import A\n")
    assert import_cycles(import_graph({"pkg": pkg})) == []
    # A private module importing its own package back, in a function: a cycle.
    (pkg / "sub" / "_b.py").write_text("def f():\n    from pkg.sub import A\n")
    graph = import_graph({"pkg": pkg})
    assert import_cycles(graph) == [["pkg.sub", "pkg.sub._b", "pkg.sub"]]
    # Two modules importing each other, one of them only for type hints (relative import).
    (pkg / "sub" / "_b.py").write_text("B = 1\n")
    (pkg / "x.py").write_text("from pkg.y import Y\n")
    (pkg / "y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import X\n"
    )
    graph = import_graph({"pkg": pkg})
    [cycle] = import_cycles(graph)
    assert cycle == ["pkg.x", "pkg.y", "pkg.x"]
    assert describe(cycle, graph) == "pkg.x (line 1) -> pkg.y (line 3) -> pkg.x"


def private_reaches(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports of another package's private module (``relax.a._x`` imported outside
    ``relax.a``): what a package offers others is its curated namespace."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            owner, _, last = target.rpartition(".")
            inside = module == owner or module.startswith(owner + ".")
            if last.startswith("_") and not last.startswith("__") and not inside:
                found.append(f"{module} (line {line}) imports {target}")
    return found


def test_no_module_reaches_into_another_package_s_private_modules() -> None:
    graph = import_graph(SOURCES)  # tests may reach in; the package and its CLI may not
    assert not private_reaches(graph), "\n".join(private_reaches(graph))


def test_a_private_reach_would_be_caught(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "_x.py").write_text("X = 1\n")
    (pkg / "a" / "_y.py").write_text("from pkg.a._x import X\n")  # inside its package: fine
    (pkg / "b" / "_z.py").write_text("def f():\n    from pkg.a._x import X\n")
    assert private_reaches(import_graph({"pkg": pkg})) == ["pkg.b._z (line 2) imports pkg.a._x"]
