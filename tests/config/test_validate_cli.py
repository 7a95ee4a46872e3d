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


# --------------------------------------------------------------------------- the preflight

AGENT = """
def solve(base_url, api_key, task, **options):
    return 1.0
"""


def _project(tmp_path: Path, body: str) -> Path:
    """A config in its own folder, next to a reward module and an agent program of the user,
    and a json.py that would break everything if it shadowed the standard library's."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "json.py").write_text("raise ImportError('the json.py next to the config')\n")
    (folder / "my_reward_fns.py").write_text(
        "def score(response, sample, **options):\n    return 1.0\n"
    )
    (folder / "my_agent_fns.py").write_text(AGENT)
    path = folder / "cluster.toml"
    path.write_text(f'[cluster]\nrun_dir = "{tmp_path / "runs"}"\n[model.init]\n{body}')
    return path


def _validate_and_up(path: Path, *args: str):
    validated = runner.invoke(app, ["validate", str(path), *args])
    started = runner.invoke(app, ["up", str(path), *args])
    return validated, started


def test_modules_next_to_the_config_import_and_never_shadow_the_standard_library(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # not the config's folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = _project(
        tmp_path,
        '[[reward.functions]]\nname = "mine"\nkind = "python"\ntarget = "my_reward_fns:score"\n',
    )
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert str(path.parent) in sys.path
    import json as real_json  # still the standard library's

    assert Path(real_json.__file__).parent.name == "json"
    assert sys.path.index(str(path.parent)) > sys.path.index(
        str(Path(real_json.__file__).parents[1])
    )


def test_validate_and_up_refuse_the_same_things_and_up_makes_no_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = _project(
        tmp_path,
        "[cluster.ports]\n"  # 4
        "bus = 5555\n"  # 5: only used over tcp, and this bus runs inproc
        "[rollout.agent]\n"  # 6
        'kind = "openai"\n'  # 7
        'program = "my_agent_fns:solv"\n'  # 8
        "[data]\n"  # 9
        'path = "missing.jsonl"\n',  # 10
    )
    validated, started = _validate_and_up(path)
    assert validated.exit_code == started.exit_code == 2, validated.output
    assert validated.stderr == started.stderr  # exactly the same checks, the same report
    lines = validated.stderr.splitlines()
    assert lines[0] == f"{path}:5: cluster.ports.bus: is only used when the bus runs over tcp" + (
        ", but it runs over inproc"
    )
    assert lines[1] == '    hint: set bus.transport = "tcp", or cluster.ports.bus = 0'
    assert f"{path}:8: rollout.agent.program: 'my_agent_fns' has no attribute 'solv'" in lines
    assert "    hint: did you mean my_agent_fns:solve?" in lines
    assert any(line.startswith(f"{path}:10: data.path: no such file") for line in lines)
    assert lines[-1] == f"{path} is invalid: 3 problems; nothing was started."
    assert "resume" not in started.output
    assert not (tmp_path / "runs").exists()

    # The same config, fixed, is valid (an openai program needs no data file).
    fixed = path.read_text().replace("solv", "solve").replace("bus = 5555", "bus = 0")
    path.write_text(fixed.replace('path = "missing.jsonl"\n', ""))
    assert runner.invoke(app, ["validate", str(path)]).exit_code == 0


def test_a_wrong_signature_and_a_missing_secret_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("RELAX_TEST_SECRET", raising=False)
    path = _project(
        tmp_path,
        '[rollout.agent]\nkind = "openai"\nprogram = "my_reward_fns:score"\n',
    )
    text = path.read_text().replace("[cluster]\n", '[cluster]\nsecret_env = "RELAX_TEST_SECRET"\n')
    path.write_text(text)
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert (
        f"{path}:2: cluster.secret_env: the environment variable RELAX_TEST_SECRET is not set"
        in (result.stderr)
    )
    assert (
        "rollout.agent.program: 'my_reward_fns:score' cannot be called as the cluster calls it"
        in (result.stderr)
    )
    monkeypatch.setenv("RELAX_TEST_SECRET", "short")
    result = runner.invoke(app, ["validate", str(path)])
    assert "must be at least 16 characters, got 5" in result.stderr


def test_a_fixed_port_in_use_is_refused_and_a_free_one_is_used(tmp_path, monkeypatch):
    import socket

    monkeypatch.setattr(sys, "path", list(sys.path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = _write(tmp_path, f"[model.init]\n[cluster.ports]\ncontrol = {port}\n")
        result = runner.invoke(app, ["validate", str(path)])
        assert result.exit_code == 2
        assert f"{path}:3: cluster.ports.control: cannot listen on 127.0.0.1:{port}" in (
            result.stderr
        )


def test_set_typos_get_the_same_hint_as_file_keys(tmp_path):
    path = _write(tmp_path, "[model.init]\n")
    result = runner.invoke(app, ["validate", str(path), "--set", "rollout.replica=2"])
    assert result.exit_code == 2
    assert "rollout.replica: unknown key 'replica'" in result.stderr
    assert "hint: did you mean 'replicas'?; set by override 'rollout.replica=2'" in result.stderr
    in_file = _write(tmp_path, "[model.init]\n[rollout]\nreplica = 2\n")
    assert "did you mean 'replicas'?" in runner.invoke(app, ["validate", str(in_file)]).stderr
