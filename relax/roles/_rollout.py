"""The rollout role: prompts in, scored-to-be samples out, always on the freshest weights.

Loop: lease a batch of prompts from the prompt bus; ask the sample bus for permission
(``admit``) to generate each prompt's group with the weights held (staleness pacing); generate
``n`` samples per prompt; put them (uid = prompt id + sample index, stable across retries);
ack the prompts. A rollout killed anywhere in between loses nothing: the prompt lease expires
and the work is redone under the same uids — and, sampling being seeded by prompt id, with
the same samples.

Weights: a follower task long-polls the weights channel and loads each new version as soon as
it is published. With ``rollout.interruptible`` the update lands between two tokens of a
generation in flight (partial rollout: every token's version is recorded in the
``token_versions`` column and the row is stamped with its oldest); otherwise it waits for the
generation to end. A restarted rollout loads the current version before it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

from relax.actors import Actor
from relax.bus import BusClient
from relax.config import ClusterConfig
from relax.engines import Generation, GenerationEngine, open_engine, stop_token_ids
from relax.roles._common import as_list, cluster_config, connect_bus, prompt_seed


async def generate_groups(
    engine: GenerationEngine, cfg: ClusterConfig, prompts: list[dict[str, Any]], stops: list[int]
) -> list[Generation]:
    """``data.n_samples_per_prompt`` samples of each prompt row, as ``[rollout]`` says, each
    prompt seeded by its id (see the module docstring)."""
    rollout = cfg.rollout
    return await engine.generate(
        [as_list(r["columns"]["prompt_ids"]) for r in prompts],
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        stop_token_ids=stops,
        n=cfg.data.n_samples_per_prompt,
        seed=None
        if rollout.seed is None
        else [prompt_seed(rollout.seed, r["uid"]) for r in prompts],
    )


class RolloutRole(Actor):
    def __init__(
        self, *, config: dict[str, Any], prompts_url: str, samples_url: str, model_dir: str
    ) -> None:
        self.cfg = cluster_config(config)
        self.prompts_url, self.samples_url, self.model_dir = prompts_url, samples_url, model_dir
        self.engine: GenerationEngine | None = None
        self._new_weights: asyncio.Condition | None = None
        self._loading = asyncio.Lock()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._idle = asyncio.Event()  # set between rounds
        self._idle.set()

    async def on_start(self) -> None:
        # In a worker thread: starting vLLM takes seconds, and heartbeats must keep flowing.
        self.engine = await asyncio.to_thread(
            open_engine, self.cfg.rollout, self.model_dir, self.cfg.model.dtype
        )

    async def on_stop(self) -> None:
        if self.engine is not None:
            await self.engine.close()

    def version(self) -> int:
        """The weights version this rollout serves."""
        return self.engine.version if self.engine else -1

    async def pause(self) -> bool:
        """Stop taking new prompts; returns once the round in flight is put (weights still
        follow while paused)."""
        self._unpaused.clear()
        await self._idle.wait()
        return True

    def resume(self) -> bool:
        """Take prompts again after ``pause``."""
        self._unpaused.set()
        return False

    def statistics(self) -> dict[str, Any]:
        """The engine's counters (requests, tokens, weight loads, interrupted loads, …)."""
        return self.engine.statistics() if self.engine else {}

    async def _sync_weights(self, bus: BusClient, wait: float) -> bool:
        """Load the newest published version, if newer than ours; True when one was loaded."""
        assert self.engine is not None and self._new_weights is not None
        got = await bus.poll_weights(after=self.engine.version, wait=wait)
        if got is None:
            return False
        async with self._loading:  # the follower and a "behind" admission may both fetch
            if got[0] <= self.engine.version:
                return False
            await self.engine.load_weights(*got)  # atomic: no forward pass sees a mix
        async with self._new_weights:
            self._new_weights.notify_all()
        self.log.debug("weights loaded", version=got[0])
        return True

    async def _follow_weights(self, bus: BusClient) -> None:
        while True:
            await self._sync_weights(bus, wait=30.0)

    async def _newer_within(self, version: int, timeout: float) -> bool:
        """Whether the engine serves a version above ``version`` within ``timeout`` seconds
        (the follower loads it)."""
        assert self.engine is not None and self._new_weights is not None
        async with self._new_weights:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._new_weights.wait_for(lambda: self.engine.version > version), timeout
                )
        return self.engine.version > version

    async def run(self) -> None:
        assert self.engine is not None
        cfg, engine = self.cfg, self.engine
        n = cfg.data.n_samples_per_prompt
        stops = stop_token_ids(engine.tokenizer) if hasattr(engine, "tokenizer") else []
        rank = self.context.rank
        self._new_weights = asyncio.Condition()
        async with (
            await connect_bus(self.prompts_url, cfg, f"rollout-{rank}-prompts") as prompts,
            await connect_bus(self.samples_url, cfg, f"rollout-{rank}") as samples,
            await connect_bus(self.samples_url, cfg, f"rollout-{rank}-weights") as weights,
        ):
            await self._sync_weights(weights, wait=0)  # serve the current version first
            follower = asyncio.create_task(self._follow_weights(weights))
            try:
                while True:
                    if follower.done():
                        follower.result()  # the follower failed: fail the role with its error
                    await self._unpaused.wait()
                    self._idle.clear()
                    try:
                        await self._round(prompts, samples, n, stops)
                    finally:
                        self._idle.set()
            finally:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower

    async def _round(
        self, prompts: BusClient, samples: BusClient, n: int, stops: list[int]
    ) -> None:
        """Lease prompts, admit what pacing allows, generate, put, ack."""
        cfg, engine = self.cfg, self.engine
        assert engine is not None
        batch = await prompts.take_batch("rollout", batch_size=cfg.rollout.batch_size, wait=1.0)
        if not batch.rows:
            return
        admitted = []
        for row in batch.rows:
            while True:
                version = engine.version
                verdict = await samples.admit(row["uid"], n, version, wait=0.0)
                if verdict == "behind":  # our weights are too old: the follower brings newer
                    timeout = cfg.rollout.weight_sync_timeout
                    if not await self._newer_within(version, timeout):
                        self.log.warning("no newer weights yet", version=version, waited_s=timeout)
                    continue
                if verdict == "ahead" and not admitted:
                    # Waiting at the bus cannot help: for a fixed version "ahead" stays so until
                    # the trainer moves on. Newer weights can: wait for them instead.
                    if await self._newer_within(version, 5.0):
                        continue
                elif verdict == "full" and not admitted:
                    verdict = await samples.admit(row["uid"], n, version, wait=5.0)
                break
            if verdict != "ok":
                break  # the rest would be refused too: generate what was admitted now
            admitted.append(row)
        waiting = [r for r in batch.rows if r not in admitted]
        if waiting:  # the trainer is behind: these prompts go back for later
            await prompts.release(replace(batch, rows=waiting))
        if not admitted:
            return
        gens = await generate_groups(engine, cfg, admitted, stops)
        rows = []
        for i, row in enumerate(admitted):
            for j in range(n):
                g = gens[i * n + j]
                columns = {
                    "prompt_ids": list(g.prompt_ids),
                    "response_ids": list(g.response_ids),
                    "logprobs": list(g.logprobs),
                    "answer": row["columns"]["answer"],
                }
                if g.token_versions is not None:
                    columns["token_versions"] = list(g.token_versions)
                rows.append(
                    {
                        "uid": f"{row['uid']}/{j}",
                        "group": row["uid"],
                        "group_size": n,
                        "version": g.version,
                        "columns": columns,
                    }
                )
        await samples.put(rows, wait=3600)
        await prompts.ack(replace(batch, rows=admitted))
