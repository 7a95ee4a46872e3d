"""A weights subscriber in its own process: polls one version and prints tensor digests.

``python -m tests.bus.weights_peer URL AFTER [GROUP_URL]``: prints ``bucket i/n`` after each
bucket and finally one JSON line ``{"version": v, "digests": {name: sha256}}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from relax.bus import BusClient


def digest(tensor) -> str:
    return hashlib.sha256(
        tensor.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy()
    ).hexdigest()


async def main(url: str, after: int, group_url: str | None) -> None:
    group = None
    if group_url:
        from relax.transport._group import open_group

        group = await open_group(group_url, rank=1, world_size=2, timeout=60)
    async with await BusClient.connect(url) as bus:
        got = await bus.poll_weights(
            after,
            wait=60,
            group=group,
            progress=lambda i, n: print(f"bucket {i}/{n}", flush=True),
        )
    assert got is not None
    version, state = got
    print(
        json.dumps({"version": version, "digests": {k: digest(v) for k, v in state.items()}}),
        flush=True,
    )
    if group is not None:
        await group.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None))
