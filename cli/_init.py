"""`relax init`: write a commented example cluster.toml from one of the recipes in examples/."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from relax.cli._app import app

DEFAULT_RECIPE = "digits"
"""What ``relax init`` writes without a recipe name: a run that visibly learns, in seconds on a
CPU (``quickstart`` is the key reference: every key at its default, which does not learn)."""
RECIPE_FILE = "cluster.toml"


def example_roots() -> list[Path]:
    """Where recipes may live, first match wins:

    1. ``RELAX_EXAMPLES`` (a folder of ``<recipe>/cluster.toml``), for custom recipe sets;
    2. the package ``relax.examples``: the repository's ``examples/`` folder, which an install
       (a wheel, or an editable install) carries as that package, found through
       ``importlib.resources``;
    3. the ``examples/`` folder of the source checkout this package runs from (an editable
       install made before ``relax.examples`` existed, or running from the repository).
    """
    import os

    import relax

    roots = []
    if os.environ.get("RELAX_EXAMPLES"):
        roots.append(Path(os.environ["RELAX_EXAMPLES"]))
    packaged = packaged_examples()
    if packaged is not None:
        roots.append(packaged)
    roots.append(Path(relax.__file__).resolve().parent.parent / "examples")
    return roots


def packaged_examples() -> Path | None:
    """The folder of the installed ``relax.examples`` package, or None when it is not
    installed (or not a plain folder, e.g. inside a zip)."""
    import importlib.resources

    try:
        found = importlib.resources.files("relax.examples")
    except ModuleNotFoundError:
        return None
    return found if isinstance(found, Path) and found.is_dir() else None


def examples_dir() -> Path | None:
    """The first folder of :func:`example_roots` holding at least one recipe."""
    for root in example_roots():
        if root.is_dir() and any(root.glob(f"*/{RECIPE_FILE}")):
            return root
    return None


def companions(recipe_toml: Path) -> list[Path]:
    """The files a recipe needs next to its cluster.toml (an agent program, a data file):
    everything else in its folder, without caches and hidden files. Its import paths name
    them as modules of the config's own folder (``program = "agent:solve"``), which
    ``relax validate`` / ``relax up`` put on ``sys.path``, so they work wherever they are
    copied."""
    return sorted(
        p
        for p in recipe_toml.parent.iterdir()
        if p.is_file()
        and p.name != RECIPE_FILE
        and not p.name.startswith(".")
        and p.suffix not in (".pyc", ".pyo")
    )


def recipes(root: Path) -> dict[str, Path]:
    """Recipe name -> its cluster.toml, sorted by name."""
    return {p.parent.name: p for p in sorted(root.glob(f"*/{RECIPE_FILE}"))}


def describe(path: Path, width: int = 72) -> str:
    """The first sentence of a recipe's leading comment (what it is about), shortened."""
    words: list[str] = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text.startswith("#") or not text.lstrip("# "):
            break
        words.append(text.lstrip("# "))
    about = " ".join(words)
    end = about.find(". ")
    about = about[: end + 1] if end >= 0 else about
    return about if len(about) <= width else about[: width - 1].rstrip() + "…"


def _print_recipes(found: dict[str, Path], *, err: bool = False) -> None:
    width = max(len(name) for name in found)
    for name, path in found.items():
        about = describe(path)
        suffix = f"  {about}" if about else ""
        default = " (default)" if name == DEFAULT_RECIPE else ""
        typer.echo(f"  {name:<{width}}{default}{suffix}", err=err)


def _complete_recipe(incomplete: str) -> list[str]:
    root = examples_dir()
    return [name for name in recipes(root) if name.startswith(incomplete)] if root else []


@app.command("init")
def init(
    recipe: Annotated[
        str,
        typer.Argument(
            help="The recipe to start from (see --list): digits learns in seconds; quickstart "
            "documents every key.",
            autocompletion=_complete_recipe,
        ),
    ] = DEFAULT_RECIPE,
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="Where to write the config.", dir_okay=False),
    ] = Path(RECIPE_FILE),
    force: Annotated[
        bool,
        typer.Option("--force", help="Overwrite OUTPUT (and the files beside it) if they exist."),
    ] = False,
    list_recipes: Annotated[
        bool, typer.Option("--list", "-l", help="List the recipes and exit.")
    ] = False,
) -> None:
    """Write an example cluster.toml (and the files its recipe needs) to edit and run.

    relax init                      # digits: learns in seconds -> ./cluster.toml

    relax init quickstart -o all.toml   # every key, commented, at its default

    relax init openai_agent -o agent/cluster.toml   # also writes agent/agent.py
    """
    root = examples_dir()
    if root is None:
        places = ", ".join(str(p) for p in example_roots())
        typer.echo(
            f"cannot find the example recipes (looked in {places}); set RELAX_EXAMPLES to a "
            "folder of <recipe>/cluster.toml, or copy one from the repository's examples/ folder",
            err=True,
        )
        raise typer.Exit(1)
    found = recipes(root)
    if list_recipes:
        typer.echo(f"recipes in {root}:")
        _print_recipes(found)
        return
    name = recipe.removesuffix("/").removesuffix(f"/{RECIPE_FILE}")
    if name not in found:
        typer.echo(f"no recipe named {recipe!r}; choose one of:", err=True)
        _print_recipes(found, err=True)
        raise typer.Exit(2)
    if output.is_dir():
        typer.echo(f"{output} is a folder; pass a file path with --output", err=True)
        raise typer.Exit(2)
    extra = [(source, output.parent / source.name) for source in companions(found[name])]
    clashes = [path for path in [output, *(dest for _, dest in extra)] if path.exists()]
    if clashes and not force:
        typer.echo(
            f"{', '.join(str(p) for p in clashes)} already exist{'s' if len(clashes) == 1 else ''}"
            "; pass --force to overwrite, or --output to write somewhere else",
            err=True,
        )
        raise typer.Exit(1)
    header = (
        f"# Written by `relax init {name}` from examples/{name}/{RECIPE_FILE}.\n"
        f"#   relax validate {output}    # check it\n"
        f"#   relax up {output}          # run it (add --detach to run it in the background)\n"
    )
    if name != "quickstart":
        header += "#   relax init quickstart -o all.toml   # every key there is, at its default\n"
    header += "#\n"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(header + found[name].read_text())
    for source, dest in extra:
        shutil.copyfile(source, dest)
    typer.echo(f"wrote {output} (recipe {name})")
    for _, dest in extra:
        typer.echo(f"wrote {dest} (imported by {output.name}: keep them together)")
    typer.echo(f"next: `relax validate {output}`, then `relax up {output}`")
