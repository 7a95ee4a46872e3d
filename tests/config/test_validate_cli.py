"""`relax validate CLUSTER_TOML`: summary on success, every problem and exit 2 on failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from relax.cli import app

HERE = Path(__file__).parent
QUICKSTART = HERE.parents[1] / "examples" / "quickstart" / "cluster.toml"

runner = CliRunner()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_valid_file_prints_summary_and_exits_0():
    result = runner.invoke(app, ["validate", str(QUICKSTART)])
    assert result.exit_code == 0, result.output
    assert 'cluster "quickstart"' in result.stdout
    assert "one-step off-policy (k=1)" in result.stdout
    assert "is valid" in result.stdout
    assert result.stderr == ""


def test_json_prints_the_validated_config(tmp_path):
    path = _write(tmp_path, 'staleness = inf\n[cluster]\nname = "j"\n[model.init]\n')
    result = runner.invoke(app, ["validate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    dumped = json.loads(result.stdout)
    assert dumped["staleness"] == "inf"
    assert dumped["cluster"]["name"] == "j"
    assert dumped["rollout"]["replicas"] == 1  # defaults are filled in


def test_bad_file_lists_every_issue_on_stderr_and_exits_2(tmp_path):
    path = _write(tmp_path, "[model.init]\n[rollout]\nreplica = 2\nplacement = 'gpu'\n")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"{path}:3: rollout.replica: unknown key 'replica'"
    assert lines[1] == "    hint: did you mean 'replicas'?"
    assert lines[2].startswith(f"{path}:4: rollout.placement: must be one of")
    assert lines[-1] == f"{path} is invalid: 2 problems; nothing was started."


def test_bad_example_from_the_test_folder(tmp_path):
    result = runner.invoke(app, ["validate", str(HERE / "bad" / "gae_without_critic.toml")])
    assert result.exit_code == 2
    assert "algorithm.advantage" in result.stderr


def test_syntax_error_names_the_line(tmp_path):
    path = _write(tmp_path, "[model.init]\nseed = \n")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert f"{path}:2: invalid TOML" in result.stderr


def test_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.toml"
    result = runner.invoke(app, ["validate", str(missing)])
    assert result.exit_code == 2
    assert f"{missing}: no such file" in result.stderr
    assert "Traceback" not in result.output


def test_set_overrides_a_key(tmp_path):
    path = _write(tmp_path, "[model.init]\n")
    result = runner.invoke(app, ["validate", str(path), "--set", "cluster.name=over", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["cluster"]["name"] == "over"

    result = runner.invoke(app, ["validate", str(path), "--set", "rollout.replicas=0"])
    assert result.exit_code == 2
    assert "rollout.replicas: expected an integer ≥ 1, got 0" in result.stderr
    assert "set by override 'rollout.replicas=0'" in result.stderr

    result = runner.invoke(app, ["validate", str(path), "--set", "oops"])
    assert result.exit_code == 2
    assert "malformed override 'oops'" in result.stderr


def test_console_module_in_a_subprocess(tmp_path):
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    ok = subprocess.run(
        [sys.executable, "-m", "relax.cli", "validate", str(QUICKSTART)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert 'cluster "quickstart"' in ok.stdout

    bad = subprocess.run(
        [sys.executable, "-m", "relax.cli", "validate", str(HERE / "bad" / "staleness_float.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert bad.returncode == 2
    assert "staleness" in bad.stderr and "got 1.5" in bad.stderr
