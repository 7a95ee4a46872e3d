"""`relax up`: pre-flight errors that start nothing, the step reports (plain lines, the progress
bar), logs routed above the bar, Ctrl-C in a terminal, a tree that gives up."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relax.cli import _up_signals, app
from relax.cli._up_progress import (
    PlainReporter,
    RichReporter,
    StepStats,
    plain_line,
    staleness_of,
)
from relax.cli._up_run_folder import resume_hint, write_run_info
from relax.cli._up_signals import SignalRouting, StopLevels
from relax.cli._up_stderr import StderrPump
from relax.config import parse_config
from tests.tiny import MODEL_INIT, tiny_toml

REPO = Path(__file__).resolve().parents[2]


def write_config(
    tmp_path: Path,
    *,
    steps: int = 2,
    data: str = "",
    rollout: str = "",
    every: int = 0,
    model: str = MODEL_INIT,
) -> Path:
    path = tmp_path / "cluster.toml"
    text = tiny_toml(
        "cli",
        steps=steps,
        lr=1e-3,
        model=model,
        cluster=f'run_dir = "{tmp_path / "runs"}"',
        data=data,
        rollout=rollout,
        extra=f"[checkpoint]\nevery_steps = {every}",
    )
    path.write_text(text)
    return path


RECORD = {
    "step": 3,
    "applied": True,
    "trainer_version_at_take": 2,
    "oldest_row_version": 1,
    "newest_row_version": 2,
    "wall_s": 0.5,
    "tokens": 100.0,
    "reward_mean": 0.25,
    "loss": -0.0123,
    "entropy": 5.5,
}


# --------------------------------------------------------------------------- fast


def test_step_reports() -> None:
    assert staleness_of(RECORD) == 1
    assert staleness_of({"step": 1}) is None
    line = plain_line(RECORD, 10)
    for part in (
        "step 3/10",
        "reward 0.2500",
        "loss -0.0123",
        "staleness 1",
        "0.50 s",
        "200 tok/s",
    ):
        assert part in line, line
    skipped = plain_line({"step": 3, "applied": False, "skipped_reason": "nan loss"}, 10)
    assert skipped == "step 3/10 skipped: nan loss"
    stats = StepStats(10)
    stats.add(RECORD)
    stats.add({**RECORD, "step": 4, "wall_s": 1.5, "tokens": 300.0, "reward_mean": 0.5})
    assert stats.done == 4
    assert stats.summary() == "reward 0.500 · 1.00 s/step · staleness 1 · 200 tok/s"


def test_progress_bar_shows_steps_and_numbers() -> None:
    from rich.console import Console

    out = io.StringIO()
    reporter = RichReporter(Console(file=out, force_terminal=True, width=120), total=10)
    reporter.start("cli", done=2)
    reporter.record(RECORD)
    reporter.log_line("a warning above the bar")
    reporter.stop()
    text = out.getvalue()
    assert "3/10" in text and "reward 0.250" in text and "staleness 1" in text
    assert "a warning above the bar" in text


def test_plain_reporter_prints_a_line_per_step(capsys) -> None:
    reporter = PlainReporter(10)
    reporter.start("cli", done=0)
    reporter.record(RECORD)
    reporter.note("stopping")
    captured = capsys.readouterr()
    assert captured.out.startswith("step 3/10  reward 0.2500")
    assert captured.err == "stopping\n"


def test_stderr_pump_shows_warnings_of_this_process_and_its_children() -> None:
    shown: list[str] = []
    warning = {"event": "lease expired", "level": "warning", "actor": "rollout-0", "rows": 3}
    info = {"event": "step", "level": "info", "actor": "trainer"}
    with StderrPump(shown.append, verbose=False):
        os.write(2, (json.dumps(info) + "\n").encode())
        os.write(2, (json.dumps(warning) + "\n").encode())
        # A child process inherits descriptor 2: its lines come through the pump too.
        subprocess.run(
            [sys.executable, "-c", "import sys; sys.stderr.write('plain child line\\n')"],
            check=True,
        )
    assert len(shown) == 2, shown
    assert "WARN" in shown[0] and "rollout-0" in shown[0] and "lease expired" in shown[0]
    assert "rows=3" in shown[0]
    assert shown[1] == "plain child line"


def test_children_started_while_running_do_not_see_ctrl_c() -> None:
    probe = [sys.executable, "-c", "print(open('/proc/self/status').read())"]

    def sigint_blocked() -> bool:
        status = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
        mask = next(line for line in status.splitlines() if line.startswith("SigBlk:"))
        return bool(int(mask.split()[1], 16) & (1 << (signal.SIGINT - 1)))

    with SignalRouting():
        assert sigint_blocked()
    assert not sigint_blocked()
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_resume_hint(tmp_path) -> None:
    toml = write_config(tmp_path)
    cfg = parse_config(toml.read_text())
    runs = tmp_path / "runs"
    (runs / "cli-20250101-000000").mkdir(parents=True)
    newest = runs / "cli-20250102-000000"
    newest.mkdir()
    assert resume_hint(toml, [], newest, cfg) == f"relax up {toml} --resume"
    other = tmp_path / "elsewhere"
    assert (
        resume_hint(toml, ["trainer.steps=9"], other, cfg)
        == f"relax up {toml} --resume --run-dir {other} --set trainer.steps=9"
    )


def test_a_secret_set_on_the_command_line_is_never_written_or_printed(tmp_path) -> None:
    toml = write_config(tmp_path)
    cfg = parse_config(toml.read_text())
    secret = "s3cret-s3cret-s3cret"
    overrides = [f"cluster.secret={secret}", "trainer.steps=3"]
    run = tmp_path / "run"
    write_run_info(run, cfg, toml, overrides)
    info = (run / "run.json").read_text()
    assert secret not in info
    assert json.loads(info)["overrides"] == ["cluster.secret=<secret>", "trainer.steps=3"]
    assert stat.S_IMODE((run / "run.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    hint = resume_hint(toml, overrides, run, cfg)
    assert secret not in hint and "--set 'cluster.secret=<secret>'" in hint


@pytest.mark.parametrize("detach", [False, True])
def test_bad_overrides_and_missing_files_start_nothing(tmp_path, detach) -> None:
    toml = write_config(tmp_path)
    runner = CliRunner()
    extra = ["--detach"] if detach else []

    def up(*args: str):
        return runner.invoke(app, ["up", str(toml), *extra, *args])

    for bad in (["--set", "trainer.steps"], ["--set", "trainer.stepz=3"]):
        result = up(*bad)
        assert result.exit_code == 2, result.output
        assert "nothing was started" in result.stderr
    missing = tmp_path / "no-such-model"
    write_config(tmp_path, model=f'[model]\npath = "{missing}"')
    result = up()
    assert result.exit_code == 2, result.output
    assert "model.path" in result.stderr and str(missing) in result.stderr
    assert "does not exist" in result.stderr and "nothing was started" in result.stderr
    result = up("--set", "data.path=missing.jsonl")
    assert result.exit_code == 2 and "data.path" in result.stderr
    assert not (tmp_path / "runs").exists()  # no run folder was made


def test_detach_and_sync_do_not_mix(tmp_path) -> None:
    toml = write_config(tmp_path)
    result = CliRunner().invoke(app, ["up", str(toml), "--detach", "--sync"])
    assert result.exit_code == 2 and "--detach" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_running_run_is_not_started_twice(tmp_path) -> None:
    toml = write_config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "control.json").write_text(json.dumps({"pid": os.getpid(), "url": "x", "token": "t"}))
    for extra in ([], ["--detach"]):
        result = CliRunner().invoke(
            app, ["up", str(toml), "--resume", "--run-dir", str(run), *extra]
        )
        assert result.exit_code == 1 and "already running" in result.stderr
        assert "relax down" in result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["control.json"]


def test_resume_without_a_run(tmp_path) -> None:
    toml = write_config(tmp_path)
    result = CliRunner().invoke(app, ["up", str(toml), "--resume"])
    assert result.exit_code == 2 and "nothing to resume" in result.stderr


# --------------------------------------------------------------------------- whole runs


@pytest.mark.slow
def test_up_reports_each_step_and_plots_at_the_end(tmp_path) -> None:
    toml = write_config(tmp_path, steps=2)
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["up", str(toml), "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    assert "step 1/2  reward" in result.stdout and "step 2/2  reward" in result.stdout
    assert "2 steps (0 skipped)" in result.stdout
    info = json.loads((run / "run.json").read_text())
    assert info["cluster_toml"] == str(toml.resolve()) and info["steps"] == 2
    assert {p.name for p in (run / "plots").iterdir()} >= {"reward.png", "staleness.png"}
    assert (run / "checkpoints" / "step-00000002" / "model.safetensors").is_file()
    # Everything the run wrote (bus segments, logs, metrics, run.json) is its owner's only.
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    for path in run.rglob("*"):
        assert not stat.S_IMODE(path.stat().st_mode) & 0o077, path


def broken_prompts(seed: int = 0):
    """A prompt source that always fails: the dataset role crashes on every restart."""
    raise RuntimeError("the prompt source is broken")
    yield  # a generator


@pytest.mark.slow
def test_a_tree_that_gives_up_exits_1_with_the_cause(tmp_path) -> None:
    toml = write_config(tmp_path, data=f'generator = "{__name__}:broken_prompts"')
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["up", str(toml), "--run-dir", str(run)])
    assert result.exit_code == 1, result.output
    assert "gave up" in result.stderr and "the prompt source is broken" in result.stderr
    assert f"relax logs --run-dir {run}" in result.stderr
    assert "resume" not in result.output  # it never trained a step: nothing to resume


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_the_tree_and_says_how_to_resume(tmp_path) -> None:
    """A real terminal: the progress bar is drawn, and Ctrl-C (sent to the whole foreground
    process group, the actors' processes included) stops the tree in order with exit 130."""
    toml = write_config(tmp_path, steps=100000, rollout='placement = "process"', every=1)
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    argv = [sys.executable, "-m", "relax.cli", "up", str(toml), "--run-dir", str(run)]
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        os.chdir(REPO)
        os.execv(sys.executable, argv)
    output, interrupted = b"", False
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the terminal closed: the child exited
                    break
                if not chunk:
                    break
                output += chunk
            if not interrupted and metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                os.write(fd, b"\x03")  # Ctrl-C, through the terminal's line discipline
                interrupted = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    text = output.decode(errors="replace")
    assert interrupted, text[-3000:]
    assert os.waitstatus_to_exitcode(status) == 130, text[-3000:]
    assert "steps" in text and "reward" in text and "staleness" in text  # the bar and its line
    assert "stopping: the tree stops in reverse order" in text
    assert f"--resume --run-dir {run}" in text
    # The rollout process was stopped by its supervisor, not killed by the Ctrl-C.
    tree_log = run / "logs" / "cli.jsonl"
    records = [json.loads(line) for line in tree_log.read_text().splitlines()]
    ended = [r for r in records if r.get("child") == "rollout-0" and r["event"] == "child ended"]
    assert not ended, ended
    stopped = [
        r for r in records if r.get("child") == "rollout-0" and r["event"] == "child stopped"
    ]
    assert stopped and stopped[-1]["how"] == "stopped by its supervisor"
    assert sorted((run / "checkpoints").glob("step-*"))


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("trained", "said"),
    [(False, "exiting at once"), (True, "exiting at once; resume with: relax up c.toml --resume")],
)
async def test_the_third_ctrl_c_names_a_resume_only_when_a_step_was_trained(
    monkeypatch, trained: bool, said: str
) -> None:
    class Exited(Exception):
        pass

    def exit_now(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(_up_signals.os, "_exit", exit_now)
    notes: list[str] = []

    async def stop_cleanly() -> None:
        pass

    levels = StopLevels(
        note=notes.append,
        stop_cleanly=stop_cleanly,
        leave=lambda: None,
        resume_text=lambda: "resume with: relax up c.toml --resume" if trained else "",
    )
    async with levels:
        levels.on_signal(signal.SIGINT)
        levels.on_signal(signal.SIGINT)
        with pytest.raises(Exited, match="130"):
            levels.on_signal(signal.SIGINT)
    assert notes[-1] == said
