"""A supervisor tree in its own process, for tests that SIGKILL the supervisor itself.

Prints one JSON line with the tree's pids once everything runs, then serves until killed.
With ``--raise-on-sigusr1`` a SIGUSR1 raises out of the event loop, as a signal handler that
raises does (pytest-timeout's, or an application's ``sys.exit`` on SIGTERM): ``asyncio.run``
then cancels every task at once, the tree's watchers with its teardown.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from relax.actors import ChildSpec, Process, Supervisor
from tests.actors.fixtures import Echo


class Raised(Exception):
    pass


def _raise(*_: object) -> None:
    raise Raised("raised by a signal handler")


async def main() -> None:
    children = [
        ChildSpec("a", Echo, placement=Process()),
        ChildSpec("g", Echo, placement=Process(), gang=2),
        ChildSpec.supervisor("sub", [ChildSpec("b", Echo, placement=Process(transport="tcp"))]),
    ]
    async with Supervisor(children) as sup:
        snap = await sup.snapshot()
        pids = [p for c in snap["children"] for p in c["pids"]]
        pids += [p for c in snap["children"][2]["children"] for p in c["pids"]]
        pids = [p for p in pids if p != snap["pid"]]  # the nested supervisor runs in this process
        if "--raise-on-sigusr1" in sys.argv:
            signal.signal(signal.SIGUSR1, _raise)
        print(json.dumps({"supervisor": snap["pid"], "children": pids}), flush=True)
        await sup.wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
