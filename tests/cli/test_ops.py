"""`relax logs`, `relax init`, `relax ckpt` and `relax down` on prepared run folders (no cluster
needed: log files, checkpoints and a stand-in cluster process are made here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relax.cli import _down as down_module
from relax.cli import app
from relax.cli._logs import format_record, last_lines, matches
from relax.config import load_config
from relax.control import CONTROL_FILE
from tests.actors.helpers import pid_alive
from tests.polling import poll_until

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


# --------------------------------------------------------------------------- logs


def line(ts: str, event: str, level: str = "info", actor: str | None = None, **kv) -> str:
    record = {"event": event, "level": level, "timestamp": f"2025-01-01T10:00:{ts}Z", "pid": 7}
    if actor:
        record["actor"] = actor
    return json.dumps({**record, **kv}) + "\n"


@pytest.fixture
def logged_run(tmp_path) -> Path:
    run = tmp_path / "run"
    logs = run / "logs"
    logs.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (logs / "trainer.jsonl").write_text(
        line("01.000", "trainer up", actor="trainer")
        + line("04.000", "step", actor="trainer", step=1, reward=0.5)
        + line("07.000", "checkpoint on stop", actor="trainer", version=1)
    )
    (logs / "rollout-0.jsonl").write_text(
        line("02.000", "engine ready", actor="rollout-0")
        + line(
            "05.000",
            "generation failed",
            "error",
            actor="rollout-0",
            exception="Traceback (most recent call last):\nRuntimeError: boom",
        )
    )
    (logs / "rollout-1.jsonl").write_text(
        line("03.000", "slow weights", "warning", actor="rollout-1", waited_s=12.5)
        + '{"event": "torn'  # a line still being written
    )
    (logs / "cluster.jsonl").write_text(line("00.000", "prometheus metrics", url="http://x"))
    return run


def events(output: str) -> list[str]:
    found = []
    for text in output.splitlines():
        for event in (
            "prometheus metrics",
            "trainer up",
            "engine ready",
            "slow weights",
            "step",
            "generation failed",
            "checkpoint on stop",
        ):
            if f" {event}" in text and not text.startswith(" "):
                found.append(event)
                break
    return found


def test_logs_interleave_every_actor_by_time(logged_run) -> None:
    result = invoke("logs", "--run-dir", logged_run)
    assert result.exit_code == 0, result.output
    assert events(result.stdout) == [
        "prometheus metrics",
        "trainer up",
        "engine ready",
        "slow weights",
        "step",
        "generation failed",
        "checkpoint on stop",
    ]
    rows = result.stdout.splitlines()
    failed = next(i for i, r in enumerate(rows) if "generation failed" in r)
    assert "ERROR" in rows[failed] and "rollout-0" in rows[failed]
    assert rows[failed + 2] == "    RuntimeError: boom"  # the traceback, indented below
    assert "waited_s=12.5" in result.stdout and "step=1 reward=0.5" in result.stdout
    assert "torn" not in result.stdout
    assert "\x1b[" not in result.stdout  # no colors when not on a terminal


def test_logs_last_lines_one_actor_a_role_a_level(logged_run) -> None:
    last = invoke("logs", "--run-dir", logged_run, "-n", "2")
    assert events(last.stdout) == ["generation failed", "checkpoint on stop"]
    trainer = invoke("logs", "trainer", "--run-dir", logged_run)
    assert events(trainer.stdout) == ["trainer up", "step", "checkpoint on stop"]
    role = invoke("logs", "rollout", "--run-dir", logged_run)
    assert events(role.stdout) == ["engine ready", "slow weights", "generation failed"]
    warnings = invoke("logs", "--run-dir", logged_run, "--level", "warning")
    assert events(warnings.stdout) == ["slow weights", "generation failed"]
    raw = invoke("logs", "rollout-1", "--run-dir", logged_run, "--json")
    assert json.loads(raw.stdout)["waited_s"] == 12.5


def test_logs_unknown_actor_lists_the_actors(logged_run) -> None:
    result = invoke("logs", "critic", "--run-dir", logged_run)
    assert result.exit_code == 2
    assert "cluster, rollout-0, rollout-1, trainer" in result.stderr
    listed = invoke("logs", "--list", "--run-dir", logged_run)
    assert listed.exit_code == 0
    assert [r.split()[0] for r in listed.stdout.splitlines()[1:]] == [
        "cluster",
        "rollout-0",
        "rollout-1",
        "trainer",
    ]
    bad_level = invoke("logs", "--run-dir", logged_run, "--level", "loud")
    assert bad_level.exit_code == 2 and "unknown level" in bad_level.stderr


def empty_run(tmp_path: Path) -> Path:
    """A run folder with an empty ``metrics.jsonl`` only: a run that has not trained yet."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    return run


def test_logs_fall_back_to_up_log_and_explain_when_there_are_none(tmp_path) -> None:
    run = empty_run(tmp_path)
    nothing = invoke("logs", "--run-dir", run)
    assert nothing.exit_code == 1 and "--detach" in nothing.stderr
    (run / "up.log").write_text(
        "cluster summary line\n"
        + line("01.000", "child started", actor="cli", child="trainer")
        + line("02.000", "step", actor="trainer", step=1)
    )
    result = invoke("logs", "trainer", "--run-dir", run)
    assert events(result.stdout) == ["step"]
    everything = invoke("logs", "--run-dir", run)
    assert "cluster summary line" in everything.stdout


def test_format_record_and_helpers(tmp_path) -> None:
    text = format_record(
        {"event": "x", "level": "warning", "actor": "a", "msg": "two words", "n": 1.0},
        color=False,
        actor_width=4,
    )
    assert text.strip() == 'WARN  a    x  msg="two words" n=1'
    assert matches("rollout-12", "rollout") and not matches("rollouts-1", "rollout")
    assert not matches("reference-0", "ref")
    path = tmp_path / "f"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(5000)) + b"partial")
    lines, partial, size = last_lines(path, 3, block=64)
    assert lines == [b"line 4997", b"line 4998", b"line 4999"]
    assert partial == b"partial" and size == path.stat().st_size
    assert len(last_lines(path, 0)[0]) == 5000


def test_shell_completion_of_actors_recipes_and_steps(logged_run, tmp_path) -> None:
    import click

    from relax.cli._ckpt import _complete_step
    from relax.cli._init import _complete_recipe
    from relax.cli._logs import _complete_actor

    ctx = click.Context(click.Command("x"))
    ctx.params = {"run_dir": logged_run}
    assert _complete_actor(ctx, "ro") == ["rollout", "rollout-0", "rollout-1"]
    assert _complete_recipe("g") == ["grpo_kl", "gspo", "guess_number"]
    ckpt = logged_run / "checkpoints" / "step-00000007"
    ckpt.mkdir(parents=True)
    assert _complete_step(ctx, "") == ["latest", "7"]


def test_logs_follow_prints_new_lines_until_the_cluster_stops(logged_run) -> None:
    # A stand-in cluster: control.json naming a live pid (this test process).
    control = logged_run / CONTROL_FILE
    control.write_text(json.dumps({"pid": os.getpid(), "url": "ipc:///nowhere", "token": "t"}))
    follow = subprocess.Popen(
        [sys.executable, "-m", "relax.cli", "logs", "-f", "-n", "1", "--run-dir", logged_run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    got = {name: threading.Event() for name in ("first", "appended", "new actor")}

    def read() -> None:
        assert follow.stdout is not None
        for text in follow.stdout:
            seen.append(text)
            for name, flag in (
                ("first", "checkpoint on stop"),
                ("appended", "weights arrived"),
                ("new actor", "reward up"),
            ):
                if flag in text:
                    got[name].set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert got["first"].wait(60), seen
        with (logged_run / "logs" / "rollout-1.jsonl").open("a") as f:
            f.write('": 1}\n')  # finishes the torn line (not JSON: shown as it is)
            f.write(line("09.000", "weights arrived", actor="rollout-1", version=2))
        assert got["appended"].wait(60), seen
        (logged_run / "logs" / "reward-0.jsonl").write_text(line("10.000", "reward up"))
        assert got["new actor"].wait(60), seen
        control.unlink()  # the cluster ended: following stops
        assert follow.wait(60) == 0
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    reader.join(10)
    assert "stopped" in (follow.stderr.read() if follow.stderr else "")
    assert not any("engine ready" in s for s in seen)  # only the last line came first


# --------------------------------------------------------------------------- init


def test_init_writes_each_recipe_and_they_validate(tmp_path) -> None:
    listed = invoke("init", "--list")
    assert listed.exit_code == 0
    names = [r.split()[0] for r in listed.stdout.splitlines()[1:]]
    assert {
        "quickstart",
        "digits",
        "grpo_kl",
        "ppo",
        "rloo",
        "reinforce_pp",
        "gspo",
        "dapo",
    } <= set(names)
    for name in names:
        out = tmp_path / f"{name}.toml"
        result = invoke("init", name, "--output", out)
        assert result.exit_code == 0, result.output
        assert f"relax up {out}" in result.stdout
        assert out.read_text().startswith(f"# Written by `relax init {name}`")
        load_config(out)  # a valid config


def test_init_defaults_and_refuses_to_overwrite(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    first = invoke("init")  # the default recipe is the one that learns (test_default_recipe_learns)
    assert first.exit_code == 0 and "recipe digits" in first.stdout
    target = tmp_path / "cluster.toml"
    assert "examples/digits" in target.read_text()
    target.write_text("# mine\n")
    again = invoke("init", "quickstart")
    assert again.exit_code == 1 and "--force" in again.stderr
    assert target.read_text() == "# mine\n"
    forced = invoke("init", "quickstart", "--force")
    assert forced.exit_code == 0 and "examples/quickstart" in target.read_text()
    unknown = invoke("init", "nope")
    assert unknown.exit_code == 2 and "quickstart" in unknown.stderr and "grpo_kl" in unknown.stderr
    listed = invoke("init", "--list").stdout
    assert re.search(r"^  digits +\(default\) ", listed, re.M), listed
    assert re.search(r"^  quickstart .*does not learn", listed, re.M), listed


def test_init_copies_the_files_a_recipe_imports_and_they_import_from_there(
    tmp_path, monkeypatch
) -> None:
    from relax.cli._init import examples_dir
    from relax.preflight import load_checked

    source = examples_dir() / "openai_agent"
    out = tmp_path / "mine" / "cluster.toml"
    result = invoke("init", "openai_agent", "--output", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {out.parent / 'agent.py'}" in result.stdout
    assert (out.parent / "agent.py").read_bytes() == (source / "agent.py").read_bytes()
    # From another working folder, with the repository off sys.path: the program imports
    # from the config's own folder (what `No module named 'examples'` used to break).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    repo = str(Path(__file__).resolve().parents[2])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", repo)])
    monkeypatch.delitem(sys.modules, "agent", raising=False)
    cfg = load_checked(out)
    assert cfg.rollout.agent.program == "agent:solve"
    assert sys.modules["agent"].__file__ == str(out.parent / "agent.py")
    monkeypatch.delitem(sys.modules, "agent")

    # A companion already there is not overwritten without --force (nor is anything else).
    (out.parent / "agent.py").write_text("# my agent\n")
    out.unlink()
    again = invoke("init", "openai_agent", "--output", out)
    assert again.exit_code == 1 and "agent.py already exists" in again.stderr
    assert not out.exists() and (out.parent / "agent.py").read_text() == "# my agent\n"
    forced = invoke("init", "openai_agent", "--output", out, "--force")
    assert forced.exit_code == 0
    assert (out.parent / "agent.py").read_bytes() == (source / "agent.py").read_bytes()


def test_init_recipes_can_come_from_elsewhere(tmp_path, monkeypatch) -> None:
    own = tmp_path / "recipes" / "mine"
    own.mkdir(parents=True)
    (own / "cluster.toml").write_text("# My recipe. Tiny.\n[model.init]\n")
    monkeypatch.setenv("RELAX_EXAMPLES", str(tmp_path / "recipes"))
    listed = invoke("init", "--list")
    assert "mine  My recipe." in listed.stdout
    monkeypatch.setenv("RELAX_EXAMPLES", str(tmp_path / "empty"))
    assert "quickstart" in invoke("init", "--list").stdout  # back to the repository's


# --------------------------------------------------------------------------- ckpt


@pytest.fixture
def run_with_checkpoints(tmp_path) -> Path:
    from relax.config import ModelInitConfig
    from relax.models import build_tiny_model

    run = tmp_path / "run"
    model = run / "model"
    init = ModelInitConfig(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
        vocab_size=261,
    )  # fmt: skip
    build_tiny_model(init, model)
    for version in (2, 4):
        ckpt = run / "checkpoints" / f"step-{version:08d}"
        ckpt.mkdir(parents=True)
        for name in ("model.safetensors", "config.json", "generation_config.json"):
            shutil.copy(model / name, ckpt / name)
        (ckpt / "relax_trainer.json").write_text(json.dumps({"format": 1, "version": version}))
        (ckpt / "trainer_state.pt").write_bytes(b"\0" * 1000)
    (run / "checkpoints" / "critic").mkdir()  # the critic's: not a policy checkpoint
    return run


def test_ckpt_list(run_with_checkpoints) -> None:
    from relax.cli._ckpt import META_FILE
    from relax.training._checkpoint import META_FILE as TRAINER_META_FILE

    assert META_FILE == TRAINER_META_FILE
    result = invoke("ckpt", "list", "--run-dir", run_with_checkpoints)
    assert result.exit_code == 0, result.output
    rows = result.stdout.splitlines()
    assert rows[0].split() == ["STEP", "VERSION", "SIZE", "SAVED", "PATH"]
    assert [r.split()[:2] for r in rows[1:3]] == [["2", "2"], ["4", "4"]]
    assert "KiB" in rows[1] and "export" in rows[3]
    data = json.loads(invoke("ckpt", "list", "--json", "--run-dir", run_with_checkpoints).stdout)
    assert [c["step"] for c in data] == [2, 4] and data[0]["bytes"] > 1000


def test_ckpt_export_loads_with_from_pretrained(run_with_checkpoints, tmp_path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    result = invoke("ckpt", "export", "latest", out, "--run-dir", run_with_checkpoints)
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert not names & {"trainer_state.pt", "relax_trainer.json"}
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    saved = load_file(
        str(run_with_checkpoints / "checkpoints" / "step-00000004" / "model.safetensors")
    )
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor)
    ids = tokenizer("1+2=")["input_ids"]
    assert tokenizer.decode(ids) == "1+2="
    again = invoke("ckpt", "export", "2", out, "--run-dir", run_with_checkpoints)
    assert again.exit_code == 1 and "--force" in again.stderr
    forced = invoke(
        "ckpt", "export", "step-00000002", out, "--force", "--run-dir", run_with_checkpoints
    )
    assert forced.exit_code == 0 and "exported step 2" in forced.stdout
    missing = invoke("ckpt", "export", "3", tmp_path / "x", "--run-dir", run_with_checkpoints)
    assert missing.exit_code == 2 and "there are steps 2, 4" in missing.stderr


def test_ckpt_export_builds_the_byte_tokenizer_when_the_run_has_no_files(
    run_with_checkpoints, tmp_path
) -> None:
    from transformers import AutoTokenizer

    shutil.rmtree(run_with_checkpoints / "model")
    (run_with_checkpoints / "metrics.jsonl").write_text("")
    (run_with_checkpoints / "run.json").write_text(json.dumps({"tokenizer": "byte"}))
    out = tmp_path / "export"
    result = invoke("ckpt", "export", "latest", out, "--run-dir", run_with_checkpoints)
    assert result.exit_code == 0, result.output
    assert AutoTokenizer.from_pretrained(out).decode([104, 105]) == "hi"


def test_ckpt_on_a_run_without_checkpoints(tmp_path) -> None:
    run = empty_run(tmp_path)
    listed = invoke("ckpt", "list", "--run-dir", run)
    assert listed.exit_code == 0 and "no checkpoints" in listed.stdout
    export = invoke("ckpt", "export", "latest", tmp_path / "out", "--run-dir", run)
    assert export.exit_code == 2 and "has no checkpoints" in export.stderr
    not_a_run = invoke("ckpt", "list", "--run-dir", tmp_path / "nothing")
    assert not_a_run.exit_code == 2 and "not a run folder" in not_a_run.stderr


# --------------------------------------------------------------------------- down


def test_down_when_nothing_runs(tmp_path) -> None:
    run = empty_run(tmp_path)
    result = invoke("down", "--run-dir", run)
    assert result.exit_code == 0 and "nothing to stop" in result.stdout
    (run / CONTROL_FILE).write_text(json.dumps({"pid": 2**22 + 1, "url": "x", "token": "t"}))
    stale = invoke("down", "--run-dir", run)
    assert stale.exit_code == 0 and "which is gone" in stale.stdout


def test_down_without_run_dir_picks_the_running_run(tmp_path, monkeypatch) -> None:
    import typer

    monkeypatch.chdir(tmp_path)
    for name in ("a-1", "b-2", "c-3"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("")
    assert down_module._running_run() is None  # none runs: the newest run is the default
    alive = json.dumps({"pid": os.getpid(), "url": "x", "token": "t"})
    (tmp_path / "runs" / "a-1" / CONTROL_FILE).write_text(alive)
    assert down_module._running_run() == Path("runs/a-1")  # not the newest, but the running one
    (tmp_path / "runs" / "b-2" / CONTROL_FILE).write_text(alive)
    with pytest.raises(typer.Exit):
        down_module._running_run()


STUBBORN = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignores SIGTERM: needs the SIGKILL
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    run = sys.argv[1]
    with open(os.path.join(run, "control.json.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "url": "ipc:///nonexistent/relax-test.sock",
                   "token": "t", "child": child.pid}, f)
    os.replace(os.path.join(run, "control.json.tmp"), os.path.join(run, "control.json"))
    time.sleep(600)
    """
)


def test_down_terminates_then_kills_a_cluster_that_does_not_stop(tmp_path, monkeypatch) -> None:
    """A stand-in cluster that neither answers its control endpoint nor obeys SIGTERM, with a
    child that ignores SIGTERM too: down escalates to SIGKILL on the process group."""
    run = empty_run(tmp_path)
    cluster = subprocess.Popen([sys.executable, "-c", STUBBORN, str(run)], start_new_session=True)
    try:
        control = run / CONTROL_FILE
        poll_until(lambda: control.exists() or cluster.poll() is not None, 60, "control.json")
        assert cluster.poll() is None
        child = json.loads(control.read_text())["child"]
        poll_until(lambda: child in down_module.descendants(cluster.pid), 30, "its child")
        monkeypatch.setattr(down_module, "GRACE_S", 1.0)
        result = invoke("down", "--run-dir", run, "--timeout", "0.5")
        assert result.exit_code == 0, result.output
        assert "SIGTERM to process group" in result.stderr and "SIGKILL" in result.stderr
        assert "no process of the run is left" in result.stdout
        assert str(child) in result.stdout  # found as a descendant, checked
        assert not pid_alive(cluster.pid) and not pid_alive(child)
        assert not control.exists()  # the stale control.json is gone
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGKILL)
        cluster.wait()


def test_snapshot_pids_walks_nested_supervisors() -> None:
    tree = {
        "pid": 10,
        "children": [
            {"id": "a", "pids": [10]},
            {"id": "b", "pids": [11, 12], "children": [{"id": "c", "pids": [13]}]},
            {"id": "d", "pids": []},
        ],
    }
    assert down_module.snapshot_pids(tree) == {10, 11, 12, 13}
