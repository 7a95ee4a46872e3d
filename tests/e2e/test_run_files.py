"""What a run leaves behind outside its folder: nothing. The buses' ipc socket folder and the
control endpoint's go when the run ends."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from relax import cluster
from relax.config import parse_config
from tests.actors.helpers import wait_until
from tests.tiny import tiny_toml

pytestmark = pytest.mark.slow


def _ipc_folder(url: str) -> Path:
    assert url.startswith("ipc://"), url
    return Path(url[len("ipc://") :]).parent


@pytest.mark.anyio
async def test_temporary_folders_are_removed_when_the_run_ends(tmp_path) -> None:
    cfg = parse_config(tiny_toml("files", steps=1, rollout='placement = "process"'))
    assert cfg.bus_transport == "ipc"
    run_dir = tmp_path / "run"
    run = asyncio.create_task(cluster.run(cfg, run_dir))
    control = run_dir / "control.json"
    await wait_until(lambda: control.exists() or run.done(), timeout=60)
    control_folder = _ipc_folder(json.loads(control.read_text())["url"])
    assert control_folder.is_dir()
    layout = await asyncio.wait_for(run, timeout=120)
    sockets = _ipc_folder(layout.samples_url)
    assert layout.sockets == sockets
    assert not sockets.exists()
    assert not control_folder.exists()


@pytest.mark.anyio
async def test_the_control_endpoint_listens_on_cluster_ports_control(tmp_path) -> None:
    import socket

    # Hold a free port the way the cluster holds its bus ports (bound, SO_REUSEADDR, not
    # listening): nobody else gets it, the endpoint may listen on it.
    with socket.socket() as hold:
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hold.bind(("127.0.0.1", 0))
        port = hold.getsockname()[1]
        cfg = parse_config(tiny_toml("ctl", steps=1, extra=f"[cluster.ports]\ncontrol = {port}"))
        server = cluster.control_server(
            cfg,
            cluster.Layout(tmp_path, tmp_path, "inproc://a", "inproc://b"),
            None,  # type: ignore[arg-type]
        )
        async with server.serving():
            info = json.loads((tmp_path / "control.json").read_text())
            assert info["url"] == f"tcp://127.0.0.1:{port}"
        assert not (tmp_path / "control.json").exists()
