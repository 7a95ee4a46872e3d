import asyncio
import random

from relax import embed
from relax.errors import RunFinished


def score(text: str) -> float:  # your own reward: here, the share of readable characters
    return sum(c.isascii() and c.isprintable() for c in text) / max(len(text), 1)


async def attempt(policy, task: str, group: str, session: str) -> None:
    [reply] = await policy.chat([{"role": "user", "content": task}], session=session, max_tokens=3)
    reward = score(reply.message["content"])
    await policy.finish(session, reward=reward, group=group, group_size=4)  # → a training row


async def main() -> None:
    async with embed.start("examples/embedded/cluster.toml") as run:
        async with await run.policy() as policy:
            played = 0
            try:
                while not run.done.done():  # until the trainer has done its steps
                    task, group = f"{random.randint(0, 9)}+{random.randint(0, 9)}=", f"g{played}"
                    # A group: four sessions of one task, scored against each other.
                    await asyncio.gather(
                        *(attempt(policy, task, group, f"{group}/{i}") for i in range(4))
                    )
                    played += 1
            except RunFinished:  # the run ended while a group was in flight
                pass
        await run.done  # raises if the run failed
        print(f"{played} groups played; run folder {run.run_dir}")


if __name__ == "__main__":
    asyncio.run(main())
