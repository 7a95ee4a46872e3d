"""A supervisor tree in its own process, for tests that SIGKILL the supervisor itself.

Prints one JSON line with the tree's pids once everything runs, then serves until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

from relax.actors import ChildSpec, Process, Supervisor
from tests.actors.fixtures import Echo


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
        print(json.dumps({"supervisor": snap["pid"], "children": pids}), flush=True)
        await sup.wait()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
