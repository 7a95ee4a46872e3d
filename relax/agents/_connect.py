"""Finding a running cluster's endpoint from its run folder."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from relax.agents._client import Policy
from relax.errors import RelaxError

ENDPOINTS_DIR = "endpoints"
"""Run-folder subfolder where each serving rollout replica writes ``<replica>.json``."""


class EndpointNotFound(RelaxError, LookupError):
    """No rollout of that run serves the endpoint (yet): start the cluster with
    ``[rollout.server] enabled = true`` (or an agent kind that needs it), or wait longer."""


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
    found through its run folder. Use it as ``async with await connect(run_dir) as policy``."""
    info = await read_endpoint(run_dir, replica, wait=wait)
    return Policy(info["url"], info.get("api_key"), timeout=timeout)
