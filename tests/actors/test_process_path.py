"""A process child imports what its parent can, but a folder of the parent's path never
shadows the standard library or site-packages in it (a json.py next to a config)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relax.actors import Actor, ChildSpec, Process, Supervisor


class PathReport(Actor):
    """Says where the child found ``json``, what its path is, and whether a user module
    (only on the parent's path) imports."""

    async def report(self, module: str) -> dict:
        import importlib
        import json

        user = importlib.import_module(module)
        return {"json": json.__file__, "path": list(sys.path), "user": user.VALUE}


@pytest.mark.anyio
async def test_a_json_py_on_the_parents_path_does_not_shadow_the_real_one(
    tmp_path, monkeypatch
) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "json.py").write_text("raise ImportError('the json.py next to the config')\n")
    (folder / "user_module_for_path_test.py").write_text("VALUE = 7\n")
    # As `relax up` does with the config's folder: appended to the parent's path.
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])
    async with Supervisor([ChildSpec("p", PathReport, placement=Process())]) as sup:
        got = await sup.ref("p").call("report", "user_module_for_path_test", timeout=30)
    assert got["user"] == 7  # the parent's folder is importable in the child
    assert Path(got["json"]).parent.name == "json"  # the standard library's package
    path = got["path"]
    stdlib = str(Path(got["json"]).parents[1])
    assert path.index(str(folder)) > path.index(stdlib)
    site = [i for i, p in enumerate(path) if p.endswith("site-packages")]
    assert site and path.index(str(folder)) > max(site)
    assert "" not in path  # not the working folder either
