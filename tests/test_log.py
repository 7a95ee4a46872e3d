"""Structured logging: JSON off a terminal, every line tagged with pid and actor id; inside a
run, one JSON file per actor in ``RUN_DIR/logs/``."""

from __future__ import annotations

import asyncio
import io
import json
import os

import pytest
import structlog

from relax.actors import Actor, ChildSpec, Process, Supervisor
from relax.log import (
    ENV_FORMAT,
    ENV_LEVEL,
    ENV_LOG_DIR,
    configure_logging,
    get_logger,
    log_file,
    log_files,
)


class Chatty(Actor):
    async def say(self, word: str) -> int:
        self.log.warning("said", word=word)
        return os.getpid()


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    # configure_logging exports its choice for child processes; keep that out of other tests.
    for name in (ENV_LEVEL, ENV_FORMAT):
        monkeypatch.setenv(name, os.environ.get(name, ""))


@pytest.fixture
def captured():
    stream = io.StringIO()
    configure_logging(level="info", fmt="json", stream=stream, force=True)
    yield stream
    structlog.reset_defaults()
    configure_logging(force=True)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


@pytest.mark.anyio
async def test_actor_lines_carry_actor_id_and_pid(captured) -> None:
    async with Supervisor([ChildSpec("chatty", Chatty)]) as sup:
        await sup.ref("chatty").call("say", "hello")
    said = [e for e in lines(captured) if e["event"] == "said"]
    assert said == [
        {
            "word": "hello",
            "actor": "chatty",
            "event": "said",
            "level": "warning",
            "pid": os.getpid(),
            "timestamp": said[0]["timestamp"],
        }
    ]
    started = [e for e in lines(captured) if e["event"] == "child started"]
    assert started and started[0]["actor"] == "root"  # the supervisor's own lines name it


def test_console_format_is_readable_and_levels_filter() -> None:
    stream = io.StringIO()
    configure_logging(level="warning", fmt="console", stream=stream, force=True)
    try:
        structlog.get_logger().info("hidden")
        structlog.get_logger().warning("shown", n=1)
    finally:
        structlog.reset_defaults()
        configure_logging(force=True)
    text = stream.getvalue()
    assert "hidden" not in text and "shown" in text and "n=1" in text
    assert not text.lstrip().startswith("{")


def test_default_stream_is_stderr_when_the_line_is_written(monkeypatch) -> None:
    # Configured while one stderr is in place, then that stderr is swapped (a test's capture
    # ending, a notebook cell): lines reach the stderr of the moment, not the stale one.
    before = io.StringIO()
    monkeypatch.setattr("sys.stderr", before)
    configure_logging(level="info", fmt="json", force=True)
    after = io.StringIO()
    monkeypatch.setattr("sys.stderr", after)
    try:
        structlog.get_logger().info("where", n=2)
    finally:
        structlog.reset_defaults()
        monkeypatch.undo()
        configure_logging(force=True)
    assert before.getvalue() == ""
    assert [(e["event"], e["n"]) for e in lines(after)] == [("where", 2)]


@pytest.mark.anyio
@pytest.mark.slow
async def test_child_process_logs_json_with_its_own_pid(tmp_path, captured) -> None:
    # A child inherits the format and level; its stderr is the supervisor's, so point it at a file.
    log_file = tmp_path / "child.log"
    with open(log_file, "w") as err:
        os_err = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            async with Supervisor([ChildSpec("far", Chatty, placement=Process())]) as sup:
                pid = await sup.ref("far").call("say", "hi")
        finally:
            os.dup2(os_err, 2)
            os.close(os_err)
    said = [json.loads(x) for x in log_file.read_text().splitlines() if '"said"' in x]
    assert said and said[0]["actor"] == "far" and said[0]["pid"] == pid != os.getpid()


def file_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_file_names() -> None:
    assert log_file("/r/logs", "reward-0").as_posix() == "/r/logs/reward-0.jsonl"
    assert log_file("/r/logs", None).name == "cluster.jsonl"
    assert log_file("/r/logs", "sub/worker 1").name == "sub_worker_1.jsonl"
    assert log_file("/r/logs", "..").name == "__.jsonl"


@pytest.mark.anyio
async def test_log_files_hold_one_json_file_per_actor(tmp_path, captured, monkeypatch) -> None:
    monkeypatch.delenv(ENV_LOG_DIR, raising=False)
    logs = tmp_path / "logs"
    with log_files(logs):
        assert os.environ[ENV_LOG_DIR] == str(logs.resolve())
        get_logger().info("outside any actor", n=1)
        async with Supervisor([ChildSpec("chatty", Chatty)], name="tree") as sup:
            await sup.ref("chatty").call("say", "hello")
    assert ENV_LOG_DIR not in os.environ  # restored
    get_logger().warning("after the run")  # no longer written to the files
    assert sorted(p.name for p in logs.iterdir()) == ["chatty.jsonl", "cluster.jsonl", "tree.jsonl"]
    (said,) = [e for e in file_lines(logs / "chatty.jsonl") if e["event"] == "said"]
    assert said["actor"] == "chatty" and said["pid"] == os.getpid() and said["word"] == "hello"
    assert said["level"] == "warning" and said["timestamp"].endswith("Z")
    assert all(e["actor"] == "chatty" for e in file_lines(logs / "chatty.jsonl"))
    assert any(e["event"] == "child started" for e in file_lines(logs / "tree.jsonl"))
    outside = file_lines(logs / "cluster.jsonl")
    assert [e["event"] for e in outside] == ["outside any actor"]
    assert "actor" not in outside[0] and outside[0]["pid"] == os.getpid()
    # The console (here: the captured stream) still gets every line.
    assert {"said", "outside any actor", "after the run"} <= {e["event"] for e in lines(captured)}


def test_log_files_restore_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_LOG_DIR, "/somewhere/else")
    with log_files(tmp_path / "a"):
        assert os.environ[ENV_LOG_DIR] == str((tmp_path / "a").resolve())
        with log_files(None):  # turned off for a nested run
            assert ENV_LOG_DIR not in os.environ
        assert os.environ[ENV_LOG_DIR] == str((tmp_path / "a").resolve())
    assert os.environ[ENV_LOG_DIR] == "/somewhere/else"


def test_concurrent_runs_ending_out_of_order_restore_the_environment(tmp_path, monkeypatch):
    """Two runs in one process (two clusters in one event loop): the first to start ends first.
    The variable must not be left naming either run (it used to keep the first one's)."""
    monkeypatch.delenv(ENV_LOG_DIR, raising=False)
    first, second = log_files(tmp_path / "a"), log_files(tmp_path / "b")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert os.environ[ENV_LOG_DIR] == str((tmp_path / "b").resolve())  # b is still running
    second.__exit__(None, None, None)
    assert ENV_LOG_DIR not in os.environ


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_child_process_writes_to_its_own_runs_folder(tmp_path, monkeypatch) -> None:
    """A child started by run a while run b (started later, still going) owns the variable:
    the child's lines go to a's folder, which is where its supervisor's context says."""
    monkeypatch.delenv(ENV_LOG_DIR, raising=False)
    with log_files(tmp_path / "a"):

        async def start_in_a() -> None:
            async with Supervisor(
                [ChildSpec("worker", Chatty, placement=Process())], name="tree"
            ) as sup:
                await sup.ref("worker").call("say", "hello")

        task = asyncio.ensure_future(start_in_a())  # a's context: tasks copy it
        with log_files(tmp_path / "b"):  # as a concurrent run would: the variable says b
            assert os.environ[ENV_LOG_DIR] == str((tmp_path / "b").resolve())
            await task
    said = [e for e in file_lines(tmp_path / "a" / "worker.jsonl") if e["event"] == "said"]
    assert said and said[0]["pid"] != os.getpid()
    assert not (tmp_path / "b" / "worker.jsonl").exists()


@pytest.mark.anyio
@pytest.mark.slow
async def test_child_process_actor_writes_its_own_log_file(tmp_path, captured) -> None:
    logs = tmp_path / "logs"
    with log_files(logs):
        async with Supervisor([ChildSpec("far", Chatty, placement=Process())]) as sup:
            pid = await sup.ref("far").call("say", "hi")
    said = [e for e in file_lines(logs / "far.jsonl") if e["event"] == "said"]
    assert said and said[0]["actor"] == "far" and said[0]["pid"] == pid != os.getpid()
    assert said[0]["level"] == "warning" and said[0]["word"] == "hi" and "timestamp" in said[0]
