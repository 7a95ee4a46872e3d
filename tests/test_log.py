"""Structured logging: JSON off a terminal, every line tagged with pid and actor id."""

from __future__ import annotations

import io
import json
import os

import pytest
import structlog

from relax.actors import Actor, ChildSpec, Process, Supervisor
from relax.log import ENV_FORMAT, ENV_LEVEL, configure_logging


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
