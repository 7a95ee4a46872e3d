"""A whole cluster over tcp:// whose shared secret comes from the environment
(``cluster.secret_env``): the buses, every role and the control endpoint use it, and a client
without it is refused."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import stat

import pytest

from relax import cluster
from relax.bus import BusClient
from relax.config import parse_config
from relax.control import control_request
from relax.errors import AuthFailed
from tests.actors.helpers import wait_until
from tests.tiny import tiny_toml

pytestmark = pytest.mark.slow


@pytest.mark.anyio
async def test_a_tcp_cluster_with_the_secret_from_the_environment(tmp_path, monkeypatch) -> None:
    secret = secrets.token_urlsafe(24)
    monkeypatch.setenv("RELAX_E2E_SECRET", secret)
    process = 'placement = "process"\nthreads = 1'
    cfg = parse_config(
        tiny_toml(
            "secret",
            staleness=1,
            steps=2,
            cluster='secret_env = "RELAX_E2E_SECRET"',
            rollout=process,  # the trainer stays in this process: also a tcp client
            extra='[bus]\ntransport = "tcp"',
        )
    )
    layout = cluster.prepare(cfg, tmp_path / "run")
    assert layout.prompts_url.startswith("tcp://127.0.0.1:")
    assert layout.samples_url.startswith("tcp://127.0.0.1:")
    # The buses' ports are held from here on: nobody else can take them before the buses
    # listen (picking a free port and closing it let anyone take it).
    for url in (layout.prompts_url, layout.samples_url):
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    serving = asyncio.create_task(cluster._serve(cfg, layout))
    try:
        control = layout.run_dir / "control.json"
        await wait_until(control.exists, timeout=60)
        assert json.loads(control.read_text())["url"].startswith("tcp://")
        # The control endpoint reaches both buses with the secret (it used to get None).
        status = await control_request(layout.run_dir, {"op": "status"})
        for name in ("prompts", "samples"):
            assert "error" not in status["bus"][name], status["bus"][name]
        # A client without the secret, or with another one, is refused by the bus.
        with pytest.raises(AuthFailed):
            await BusClient.connect(layout.samples_url, secret=None, connect_timeout=10)
        with pytest.raises(AuthFailed):
            await BusClient.connect(layout.samples_url, secret="x" * 32, connect_timeout=10)
        async with await BusClient.connect(layout.samples_url, secret=secret) as bus:
            assert "weights" in await bus.statistics()
        await asyncio.wait_for(serving, timeout=120)  # the run trains all its steps
    finally:
        serving.cancel()
        layout.release()
    steps = [
        json.loads(line) for line in (layout.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [s["step"] for s in steps if s["applied"]] == [1, 2]
    assert stat.S_IMODE(layout.run_dir.stat().st_mode) == 0o700
    # The secret stays in the environment: no file of the run holds it.
    for path in layout.run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
