"""Environments for the e2e tests: GuessNumber whose tool breaks on some tasks."""

from __future__ import annotations

import asyncio
import zlib

from relax.agents import Step
from relax.agents.envs import GuessNumber


class FlakyGuess(GuessNumber):
    """GuessNumber whose second step raises for a third of the tasks and hangs for another
    third (picked by task id, so a replayed episode fails the same way)."""

    async def reset(self, task):
        self.fate = zlib.crc32(task["id"].encode()) % 3
        self.steps = 0
        return await super().reset(task)

    async def step(self, action: str) -> Step:
        self.steps += 1
        if self.steps == 2 and self.fate == 1:
            raise RuntimeError("the game server crashed")
        if self.steps == 2 and self.fate == 2:
            await asyncio.Event().wait()
        return await super().step(action)
