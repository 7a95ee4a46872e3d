"""Finding a running cluster's endpoint from its run folder."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from relax.agents._client import Policy
from relax.errors import EndpointNotFound

ENDPOINTS_DIR = "endpoints"
"""Run-folder subfolder where each serving rollout replica writes ``<replica>.json``."""


def endpoint_file(run_dir: str | Path, replica: int = 0) -> Path:
    return Path(run_dir) / ENDPOINTS_DIR / f"rollout-{replica}.json"


async def read_endpoint(
    run_dir: str | Path, replica: int = 0, *, wait: float = 0.0
) -> dict[str, Any]:
    """``{"url", "api_key", "model"}`` of replica ``replica``'s endpoint, waiting up to ``wait``
    seconds for the rollout to start serving."""
    path = endpoint_file(run_dir, replica)
    deadline = time.monotonic() + wait
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            if time.monotonic() >= deadline:
                raise EndpointNotFound(
                    f"no endpoint at {path}: is the cluster running with [rollout.server]"
                    " enabled (or agent kind 'openai'/'external')?"
                ) from None
        await asyncio.sleep(0.05)  # the rollout writes the file once it serves


async def connect(
    run_dir: str | Path, replica: int = 0, *, wait: float = 0.0, timeout: float = 300
) -> Policy:
    """A ``Policy`` client of a running cluster (started by ``relax up`` or ``relax.embed``),
    found through its run folder. Use it as ``async with await connect(run_dir) as policy``.

    Its calls raise ``RunFinished`` once the run has ended: the endpoint refused a call and the
    rollout removed its endpoint file (as it does when the cluster stops)."""
    info = await read_endpoint(run_dir, replica, wait=wait)
    path = endpoint_file(run_dir, replica)

    async def ended(within: float) -> str | None:
        return await endpoint_closed(path, info["url"], within)

    return Policy(info["url"], info.get("api_key"), timeout=timeout, run_ended=ended)


async def endpoint_closed(path: Path, url: str, within: float) -> str | None:
    """Why the endpoint at ``url`` (announced in ``path``) is gone for good, if it is within
    ``within`` seconds: its file was removed (the cluster stopped). ``None`` while the file
    still announces it, or announces a restarted rollout's new endpoint (connect again)."""
    deadline = time.monotonic() + within
    while True:
        try:
            announced = _announced(path)
        except FileNotFoundError:
            return f"its endpoint {url} was closed when the cluster stopped"
        except (json.JSONDecodeError, OSError, AttributeError):
            announced = url  # being rewritten: look again
        if announced != url or time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.05)  # the rollout removes the file once its server has closed


def _announced(path: Path) -> Any:
    """The url an endpoint file announces (a tiny local file: read on the loop)."""
    return json.loads(path.read_text()).get("url")
