"""`relax init`: write a commented example cluster.toml from one of the recipes in examples/."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from relax.cli._app import app

DEFAULT_RECIPE = "quickstart"
RECIPE_FILE = "cluster.toml"


def example_roots() -> list[Path]:
    """Where recipes may live, first match wins:

    1. ``RELAX_EXAMPLES`` (a folder of ``<recipe>/cluster.toml``), for custom recipe sets;
    2. the ``examples/`` folder of the source checkout this package runs from (an editable
       install, or running from the repository);
    3. ``<prefix>/share/relax/examples`` (where a wheel can install them as data files).
    """
    import os

    import relax

    roots = []
    if os.environ.get("RELAX_EXAMPLES"):
        roots.append(Path(os.environ["RELAX_EXAMPLES"]))
    roots.append(Path(relax.__file__).resolve().parent.parent / "examples")
    roots.append(Path(sys.prefix) / "share" / "relax" / "examples")
    return roots


def examples_dir() -> Path | None:
    """The first folder of :func:`example_roots` holding at least one recipe."""
    for root in example_roots():
        if root.is_dir() and any(root.glob(f"*/{RECIPE_FILE}")):
            return root
    return None


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
            help="The recipe to start from (see --list): quickstart documents every key.",
            autocompletion=_complete_recipe,
        ),
    ] = DEFAULT_RECIPE,
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="Where to write the config.", dir_okay=False),
    ] = Path(RECIPE_FILE),
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT if it exists.")] = False,
    list_recipes: Annotated[
        bool, typer.Option("--list", "-l", help="List the recipes and exit.")
    ] = False,
) -> None:
    """Write an example cluster.toml, commented key by key, to edit and run.

    relax init                      # quickstart -> ./cluster.toml

    relax init grpo_kl -o kl.toml   # the GRPO + KL recipe
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
    if output.exists() and not force:
        typer.echo(
            f"{output} already exists; pass --force to overwrite it, or --output to write "
            "somewhere else",
            err=True,
        )
        raise typer.Exit(1)
    if output.is_dir():
        typer.echo(f"{output} is a folder; pass a file path with --output", err=True)
        raise typer.Exit(2)
    header = (
        f"# Written by `relax init {name}` from examples/{name}/{RECIPE_FILE}.\n"
        f"#   relax validate {output}    # check it\n"
        f"#   relax up {output}          # run it (add --detach to run it in the background)\n"
        "#\n"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(header + found[name].read_text())
    typer.echo(f"wrote {output} (recipe {name})")
    typer.echo(f"next: `relax validate {output}`, then `relax up {output}`")
