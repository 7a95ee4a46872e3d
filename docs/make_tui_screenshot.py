"""Regenerate ``docs/tui.svg``: the `relax status` dashboard against a real (tiny) cluster.

    python docs/make_tui_screenshot.py [OUT.svg]

Starts a small cluster in a temporary folder (CPU, a random-init model; the reward role in its
own process), lets it train a few steps, SIGKILLs the reward process once so the screenshot shows
a crash cause and a restart, opens the dashboard headless, saves the screenshot and stops the
cluster. Takes about a minute.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from relax import cluster
from relax.cli._tui import StatusApp
from relax.config import parse_config
from relax.control import CONTROL_FILE, control_request

TOML = """
# the examples/digits recipe (rewarded for answering with a digit, so the reward climbs),
# the reward role in its own process, and no step limit: the script stops it
staleness = 1
[cluster]
name = "digits"
[model.init]
hidden_size = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 128
vocab_size = 261
[data]
n_samples_per_prompt = 8
[rollout]
max_new_tokens = 3
batch_size = 4
[[reward.functions]]
name = "digit"
kind = "regex"
pattern = "^[0-9]"
[reward]
placement = "process"
[bus]
lease_timeout = 5
[trainer]
steps = 100000
global_batch_size = 32
micro_batch_size = 32
lr = 0.005
"""


async def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def main(out: Path) -> None:
    home = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="relax-tui-") as tmp:
        # A relative run folder, as `relax up` makes under ./runs: the picture shows no
        # temporary path of the machine that drew it.
        os.chdir(tmp)
        try:
            await screenshot(Path("runs") / "digits-20260101-120000", out)
        finally:
            os.chdir(home)
    print(f"wrote {out}")


async def screenshot(run_dir: Path, out: Path) -> None:
    running = asyncio.create_task(cluster.run(parse_config(TOML), run_dir))

    async def status() -> dict:
        return await control_request(run_dir, {"op": "status", "history": 100})

    async def reward() -> dict:
        return next(c for c in (await status())["tree"]["children"] if c["id"] == "reward-0")

    async def up() -> bool:
        return (run_dir / CONTROL_FILE).exists()

    async def trained(n: int) -> bool:
        return (await status())["trainer"]["version"] >= n

    try:
        await _wait(up, 120, "the cluster to start")
        await _wait(lambda: trained(8), 180, "a few training steps")
        before = await reward()
        os.kill(before["pids"][0], signal.SIGKILL)

        async def restarted() -> bool:
            now = await reward()
            return now["restart_count"] > before["restart_count"] and now["state"] == "running"

        await _wait(restarted, 120, "the reward role to come back")
        await _wait(lambda: trained(40), 180, "more training steps")
        app = StatusApp(run_dir, interval=0.5)
        async with app.run_test(size=(150, 36)) as pilot:
            polls = app.polls
            await _wait(lambda: _true(app.polls >= polls + 2), 60, "the dashboard to refresh")
            app.query_one("#actors").move_cursor(row=3)  # reward-0
            await pilot.pause()
            svg = app.export_screenshot(title="relax status")
            await asyncio.to_thread(out.write_text, svg)
            await pilot.press("q")
    finally:
        if (run_dir / CONTROL_FILE).exists():
            await control_request(run_dir, {"op": "stop"})
        await asyncio.wait_for(running, 120)


async def _true(value: bool) -> bool:
    return value


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("tui.svg")
    asyncio.run(main(target.resolve()))
