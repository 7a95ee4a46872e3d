"""A real tiny cluster: its Prometheus endpoint, its per-actor log files, its TensorBoard
events (written by a trainer in a child process)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relax import cluster
from relax.config import parse_config
from relax.control import CONTROL_FILE, control_request
from relax.errors import ConfigError
from relax.log import ENV_LOG_DIR
from tests.actors.helpers import find, wait_until
from tests.observe.helpers import toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # the dev extra has it
CONFIG = toml(
    trainer='placement = "process"',
    extra=f"[logging]\ntensorboard = {str(HAS_TENSORBOARD).lower()}",
)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.mark.timeout(240)
async def test_metrics_endpoint_log_files_and_tensorboard_of_a_running_cluster(
    tmp_path: Path, json_logs
) -> None:
    run_dir = tmp_path / "run"
    running = asyncio.create_task(cluster.run(parse_config(CONFIG), run_dir))
    await wait_until(lambda: (run_dir / CONTROL_FILE).exists(), timeout=90, what="control.json")
    url = json.loads((run_dir / CONTROL_FILE).read_text())["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    status = await control_request(run_dir, {"op": "status", "history": 1})
    assert status["metrics_url"] == url

    async def version() -> float:
        got = sample(await asyncio.to_thread(scrape, url), "relax_trainer_version")
        return -1 if got is None else got

    await wait_until(lambda: _above(version, 0), timeout=90, what="a published version")
    first = await version()
    await wait_until(lambda: _above(version, first), timeout=90, what="the version to grow")

    assert await control_request(run_dir, {"op": "restart", "child": "reward-0"})
    samples = await asyncio.to_thread(scrape, url)
    status = await control_request(run_dir, {"op": "status", "history": 1})
    for actor in ("reward-0", "trainer", "dataset", "samples"):  # the numbers of relax status
        restarts = sample(samples, "relax_actor_restarts_total", actor=actor)
        assert restarts == find(status["tree"], actor)["restart_count"]
    assert sample(samples, "relax_actor_restarts_total", actor="reward-0") == 1
    assert sample(samples, "relax_actor_up", actor="trainer", kind="worker", placement="process")
    assert sample(samples, "relax_actor_state", actor="trainer", state="running") == 1
    assert sample(samples, "relax_bus_up", bus="samples") == 1
    assert sample(samples, "relax_bus_put_total", bus="samples") > 0
    assert sample(samples, "relax_bus_capacity", bus="samples") == 1024
    assert sample(samples, "relax_bus_task_lag", bus="samples", task="train") is not None
    assert sample(samples, "relax_trainer_reward_mean") is not None
    assert sample(samples, "relax_trainer_step_time_s") > 0

    assert await control_request(run_dir, {"op": "stop"}) == {"stopping": True}
    layout = await asyncio.wait_for(running, 90)
    assert ENV_LOG_DIR not in os.environ  # put back as it was
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(urllib.request.urlopen, url, timeout=5)

    # One JSON file per actor, from this process and from the trainer's child process.
    logs = layout.run_dir / "logs"
    files = {p.stem: p for p in logs.glob("*.jsonl")}
    # (Debug level: the in-process rollout says when it loads weights.)
    assert {"cluster", "obs", "prompts", "samples", "rollout-0", "trainer"} <= set(files)
    by_file = {
        name: [json.loads(line) for line in p.read_text().splitlines()] for name, p in files.items()
    }
    for name, events in by_file.items():
        assert events, name
        for event in events:
            assert {"event", "level", "timestamp", "pid"} <= set(event), (name, event)
            assert event.get("actor", "cluster") == name, (name, event)
    trainer_pids = {e["pid"] for e in by_file["trainer"]}
    assert os.getpid() not in trainer_pids  # written by the child process
    assert any(e["event"] == "step" for e in by_file["trainer"])
    assert {e["pid"] for e in by_file["rollout-0"]} == {os.getpid()}  # in-process
    assert any(e["event"] == "weights loaded" for e in by_file["rollout-0"])
    assert any(e["event"] == "prometheus metrics" for e in by_file["cluster"])
    assert any(e["event"] == "child started" for e in by_file["obs"])  # the root supervisor

    # TensorBoard events from the trainer in its child process.
    if not HAS_TENSORBOARD:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(layout.run_dir / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("reward_mean")]
    assert steps and steps == sorted(steps) and steps[-1] >= first


async def _above(value, floor: float) -> bool:
    return await value() > floor


async def test_a_taken_metrics_port_is_a_clear_config_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = parse_config(toml(cluster=f"ports.metrics = {port}"))
        with pytest.raises(ConfigError, match=r"cluster\.ports\.metrics: .*127\.0\.0\.1"):
            await cluster.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / CONTROL_FILE).exists()
    assert ENV_LOG_DIR not in os.environ
