"""The critic role: the value model PPO's GAE advantages need, trained alongside the policy.

Loop: lease rows under task ``"critic"`` once they have a ``reward``; compute each response
token's value with the *current* critic and write the ``values`` column (the trainer waits
for it when ``algorithm.advantage = "gae"``); then train the critic on those same rows —
returns from GAE over the values just written, so they are the targets the trainer's
advantages imply — and ack. Values are always written before the critic learns from the
batch, so the trainer and the critic see the same numbers.

The critic starts from ``critic.model_path`` or else the policy's model (its transformer body
with a fresh value head). It checkpoints under ``<run>/<checkpoint.dir>/critic/`` every
``checkpoint.every_steps`` updates (every 10 when that is 0), and when it stops, atomically;
a restarted critic (or a resumed run) continues from the newest one instead of silently
starting over. Per-update metrics go to ``critic.jsonl`` in the run folder.

Settings the config does not have (yet) are module constants: the value clip range, the
gradient clip and the passes per batch.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

from relax.config import ClusterConfig
from relax.models import load_tokenizer
from relax.roles._common import (
    LearnerRole,
    client_name,
    connect_bus,
    training_row,
    without_poisoned,
    write_once,
)
from relax.schema import LOGPROBS, LOSS_MASK, PROMPT_IDS, REF_LOGPROBS, RESPONSE_IDS, REWARD, VALUES
from relax.training import CriticTrainer, ValueModel

VALUE_CLIP = 0.5
"""PPO value clip range (as verl's default ``cliprange_value``)."""
GRAD_CLIP = 1.0
"""The critic's gradients are rescaled to at most this global norm."""
EPOCHS = 2
"""Optimiser passes over each batch; the value clip keeps the second one near the first."""
CHECKPOINT_EVERY = 10
"""Critic updates between checkpoints when ``checkpoint.every_steps`` is 0."""


def critic_columns(cfg: ClusterConfig) -> tuple[str, ...]:
    """The columns a row needs before the critic may take it."""
    columns = [PROMPT_IDS, RESPONSE_IDS, REWARD]
    if cfg.algorithm.kl.coef > 0 and cfg.algorithm.kl.mode == "reward":
        columns += [LOGPROBS, REF_LOGPROBS]  # the KL penalty is part of the reward
    return tuple(columns)


class CriticRole(LearnerRole):
    METRICS_FILE = "critic.jsonl"

    def __init__(
        self, *, config: dict[str, Any], samples_url: str, model_dir: str, run_dir: str
    ) -> None:
        super().__init__(
            config=config, samples_url=samples_url, model_dir=model_dir, run_dir=run_dir
        )
        self.already_written = 0
        self.critic: CriticTrainer | None = None

    def _checkpoints(self) -> Path:
        return self.run_dir / self.cfg.checkpoint.dir / "critic"

    def _latest_checkpoint(self) -> Path | None:
        folder = self._checkpoints()
        found = sorted(folder.glob("update-*")) if folder.exists() else []
        return found[-1] if found else None

    async def on_start(self) -> None:
        cfg = self.cfg
        path = cfg.critic.model_path or self.model_dir
        model = await asyncio.to_thread(
            ValueModel.from_pretrained,
            path,
            cfg.trainer.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        tokenizer = load_tokenizer(self.model_dir)
        pad = tokenizer.pad_token_id
        self.critic = CriticTrainer(
            model,
            cfg.algorithm,
            lr=cfg.critic.lr,
            pad_id=int(pad if pad is not None else (tokenizer.eos_token_id or 0)),
            grad_clip=GRAD_CLIP,
            value_clip=VALUE_CLIP,
            micro_batch_size=cfg.trainer.micro_batch_size,
            epochs=EPOCHS,
        )
        latest = self._latest_checkpoint()
        if latest is not None:
            await asyncio.to_thread(self.critic.load_checkpoint, latest)
            self.log.info("critic resumed", path=str(latest), updates=self.critic.updates)

    def metrics(self) -> list[dict[str, Any]]:
        """The latest ``HISTORY_KEPT`` updates' metrics (all are in ``critic.jsonl``)."""
        return list(self.history)

    def statistics(self) -> dict[str, Any]:
        critic = self.critic
        return {
            "updates": critic.updates if critic else 0,
            "skipped": critic.skipped if critic else 0,
            "already_written": self.already_written,
        }

    async def run(self) -> None:
        assert self.critic is not None
        cfg, critic = self.cfg, self.critic
        columns = critic_columns(cfg)
        every = cfg.checkpoint.every_steps or CHECKPOINT_EVERY
        async with await connect_bus(self.samples_url, cfg, client_name(self.context)) as bus:
            while True:
                async with bus.take(
                    "critic",
                    batch_size=cfg.trainer.global_batch_size,
                    columns=list(columns),
                    optional=[LOSS_MASK],
                    whole_groups=True,  # whole groups make fuller, steadier critic batches
                    wait=1.0,
                ) as batch:
                    await without_poisoned(bus, batch, self.log)  # e.g. reward = "high"
                    if not batch.rows:
                        continue
                    started = time.monotonic()
                    rows = [training_row(r, columns) for r in batch.rows]
                    values = await asyncio.to_thread(critic.values, rows)
                    self.already_written += await write_once(
                        bus,
                        [
                            (row["uid"], {VALUES: vals})
                            for row, vals in zip(batch.rows, values, strict=True)
                        ],
                    )
                    applied, metrics = await asyncio.to_thread(critic.train, rows, values)
                    self._record(
                        {"applied": applied, "wall_s": time.monotonic() - started, **metrics}
                    )
                    if applied and critic.updates % every == 0:
                        await asyncio.to_thread(self._checkpoint)

    async def on_stop(self) -> None:
        # Waits (in a thread) for an update still running in a worker thread, then saves.
        if self.critic is not None and self.critic.updates > 0:
            await asyncio.to_thread(self._checkpoint)

    def _checkpoint(self) -> None:
        assert self.critic is not None
        target = self._checkpoints() / f"update-{self.critic.updates:08d}"
        self.critic.save_checkpoint(target)
        keep = self.cfg.checkpoint.keep_last
        old = sorted(self._checkpoints().glob("update-*"))
        for stale in old[:-keep] if keep else []:
            shutil.rmtree(stale, ignore_errors=True)

    def _record(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
