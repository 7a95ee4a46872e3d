"""The rollout role: prompts in, scored-to-be samples out, always on the freshest weights.

Loop: pick up new weights if the trainer published any; lease a batch of prompts from the
prompt bus; ask the sample bus for permission (``admit``) to generate each prompt's group with
the weights held (staleness pacing); generate ``n`` samples per prompt; put them (uid =
prompt id + sample index, stable across retries); ack the prompts. A rollout killed anywhere
in between loses nothing: the prompt lease expires and the work is redone under the same uids.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from relax.actors import Actor
from relax.engines import HFEngine, stop_token_ids
from relax.errors import BusError
from relax.roles._common import as_list, cluster_config, connect_bus


class RolloutRole(Actor):
    def __init__(
        self, *, config: dict[str, Any], prompts_url: str, samples_url: str, model_dir: str
    ) -> None:
        self.cfg = cluster_config(config)
        self.prompts_url, self.samples_url, self.model_dir = prompts_url, samples_url, model_dir
        self.engine: HFEngine | None = None

    async def on_start(self) -> None:
        if self.cfg.rollout.engine != "hf":
            raise BusError("only the hf engine is available so far; set rollout.engine = 'hf'")
        self.engine = HFEngine.from_pretrained(self.model_dir, self.cfg.model.dtype)

    def version(self) -> int:
        """The weights version this rollout serves."""
        return self.engine.version if self.engine else -1

    async def _sync_weights(self, samples: Any, wait: float) -> None:
        assert self.engine is not None
        got = await samples.poll_weights(after=self.engine.version, wait=wait)
        if got is not None:
            await self.engine.load_weights(*got)  # atomic: no generation sees a mix

    async def run(self) -> None:
        assert self.engine is not None
        cfg, engine = self.cfg, self.engine
        n = cfg.data.n_samples_per_prompt
        stops = stop_token_ids(engine.tokenizer) if hasattr(engine, "tokenizer") else []
        async with (
            await connect_bus(
                self.prompts_url, cfg, f"rollout-{self.context.rank}-prompts"
            ) as prompts,
            await connect_bus(self.samples_url, cfg, f"rollout-{self.context.rank}") as samples,
        ):
            while True:
                await self._sync_weights(samples, wait=0)
                batch = await prompts.take_batch(
                    "rollout", batch_size=cfg.rollout.batch_size, wait=1.0
                )
                if not batch.rows:
                    continue
                admitted = []
                for row in batch.rows:
                    while True:
                        verdict = await samples.admit(row["uid"], n, engine.version, wait=5.0)
                        if verdict == "behind":  # our weights are too old: wait for newer ones
                            await self._sync_weights(samples, wait=cfg.rollout.weight_sync_timeout)
                            continue
                        break
                    if verdict == "ok":
                        admitted.append(row)
                waiting = [r for r in batch.rows if r not in admitted]
                if waiting:  # the trainer is behind: these prompts go back for later
                    await prompts.release(replace(batch, rows=waiting))
                if not admitted:
                    continue
                gens = await engine.generate(
                    [as_list(r["columns"]["prompt_ids"]) for r in admitted],
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p,
                    top_k=cfg.rollout.top_k,
                    stop_token_ids=stops,
                    n=n,
                )
                rows = []
                for i, row in enumerate(admitted):
                    for j in range(n):
                        g = gens[i * n + j]
                        rows.append(
                            {
                                "uid": f"{row['uid']}/{j}",
                                "group": row["uid"],
                                "group_size": n,
                                "version": g.version,
                                "columns": {
                                    "prompt_ids": list(g.prompt_ids),
                                    "response_ids": list(g.response_ids),
                                    "logprobs": list(g.logprobs),
                                    "answer": row["columns"]["answer"],
                                },
                            }
                        )
                await samples.put(rows, wait=3600)
                await prompts.ack(replace(batch, rows=admitted))
