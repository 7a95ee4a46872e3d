"""`relax init` from an installed wheel: the recipes (and the files they import) are packaged
as ``relax.examples`` and found through ``importlib.resources``, not through a source tree.

The wheel is built from a copy of the sources (so the checkout gets no build/ folder), then
unpacked into a folder that the child processes put first on ``sys.path``: they import that
``relax``, with no ``examples/`` folder anywhere near it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("relax", "cli", "examples", "setup.py", "pyproject.toml", "README.md")


def _setuptools_builds_this() -> bool:
    """Whether this environment's setuptools can build the project without a build
    environment of its own (pyproject.toml asks for setuptools>=77)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist")]
    if _setuptools_builds_this():  # else pip makes an isolated build environment
        command.append("--no-build-isolation")
    subprocess.run([*command, str(src)], check=True, timeout=300)
    (found,) = (root / "dist").glob("relax_rl-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_carries_every_recipe_and_its_files(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    recipes = sorted(p.parent for p in (REPO / "examples").glob("*/cluster.toml"))
    assert len(recipes) >= 10
    for folder in recipes:
        for path in folder.iterdir():
            if path.is_file() and path.suffix in (".toml", ".py", ".md", ".json", ".jsonl"):
                assert f"relax/examples/{folder.name}/{path.name}" in names, path
    assert "relax/examples/__init__.py" in names
    assert not any(name.startswith(("examples/", "cli/")) for name in names)  # no top level


@pytest.mark.slow
def test_relax_init_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RELAX_EXAMPLES")}
    env["PYTHONPATH"] = str(site)  # ahead of the checkout's editable install

    def relax(*args: str) -> subprocess.CompletedProcess[str]:
        code = (
            "import sys, relax, relax.cli\n"
            f"assert relax.__file__.startswith({str(site)!r}), relax.__file__\n"
            "sys.argv = ['relax', *sys.argv[1:]]\n"
            "relax.cli.main()\n"
        )
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    listed = relax("init", "--list")
    assert listed.returncode == 0, listed.stderr
    assert f"recipes in {site / 'relax' / 'examples'}" in listed.stdout
    assert "openai_agent" in listed.stdout and "digits" in listed.stdout

    made = relax("init", "openai_agent", "-o", "agent/cluster.toml")
    assert made.returncode == 0, made.stderr
    assert (work / "agent" / "agent.py").read_text() == (
        REPO / "examples" / "openai_agent" / "agent.py"
    ).read_text()
    # The copy validates from its own folder: its program imports (the preflight checks it).
    checked = relax("validate", "agent/cluster.toml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
