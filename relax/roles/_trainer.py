"""The trainer role: takes whole groups within the staleness bound, steps, publishes weights.

Each step: lease ``global_batch_size`` rows (whole groups, reward present); train; on success
publish the new weights as version N+1 (which also moves the bus's trainer version, so stale
rows are dropped and producers are paced); ack the rows; checkpoint every ``every_steps``.
A skipped step (NaN loss, exploding gradients) publishes nothing and gives the rows back
acked: they were consumed, and retrying the same poisoned batch would skip again.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

from relax.actors import Actor
from relax.config import ClusterConfig
from relax.engines import load_policy
from relax.roles._common import as_list, cluster_config, connect_bus
from relax.training import TorchBackend


def train_columns(cfg: ClusterConfig) -> tuple[str, ...]:
    """The columns a row needs before the trainer may take it."""
    columns = ["prompt_ids", "response_ids", "logprobs", "reward"]
    if cfg.algorithm.kl.coef > 0:
        columns.append("ref_logprobs")  # written by the reference role
    if cfg.algorithm.advantage == "gae":
        columns.append("values")  # written by the critic role
    return tuple(columns)


def train_row(row: dict[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    """A bus row as the training backend's ``Row``."""
    cols = row["columns"]
    out: dict[str, Any] = {"group": row["group"], "uid": row["uid"]}
    for name in columns:
        out[name] = float(cols[name]) if name == "reward" else as_list(cols[name])
    return out


class TrainerRole(Actor):
    def __init__(
        self, *, config: dict[str, Any], samples_url: str, model_dir: str, run_dir: str
    ) -> None:
        self.cfg = cluster_config(config)
        self.samples_url, self.model_dir = samples_url, model_dir
        self.run_dir = Path(run_dir)
        self.metrics_file = self.run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []

    async def on_start(self) -> None:
        model, tokenizer = load_policy(self.model_dir, self.cfg.trainer.dtype)
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.backend = TorchBackend(
            model,
            self.cfg.trainer,
            self.cfg.algorithm,
            pad_id=pad,
            temperature=self.cfg.rollout.temperature,
        )
        # A trainer restarted inside a run (or a run resumed into its old folder) continues
        # from its newest checkpoint; see run() for weights published after that checkpoint.
        latest = self._latest_checkpoint()
        if latest is not None:
            self.backend.load_checkpoint(latest)
            self.log.info("resumed from checkpoint", path=str(latest), version=self.backend.version)

    def version(self) -> int:
        return self.backend.version

    def metrics(self) -> list[dict[str, Any]]:
        """Every step's metrics so far (also in ``metrics.jsonl`` in the run folder)."""
        return list(self.history)

    def _checkpoints(self) -> Path:
        return self.run_dir / self.cfg.checkpoint.dir

    def _latest_checkpoint(self) -> Path | None:
        found = sorted(self._checkpoints().glob("step-*")) if self._checkpoints().exists() else []
        return found[-1] if found else None

    async def run(self) -> None:
        cfg = self.cfg
        size = cfg.trainer.global_batch_size
        columns = train_columns(cfg)
        async with await connect_bus(self.samples_url, cfg, "trainer") as bus:
            published = (await bus.statistics())["weights"]["current"]
            newer = (
                await bus.poll_weights(after=self.backend.version, wait=0)
                if published > self.backend.version
                else None
            )
            if newer is not None:  # published after our last checkpoint: continue from there
                self.backend.adopt(*newer)
                self.log.warning("continuing from published weights", version=newer[0])
            elif published < self.backend.version:  # a resumed run: the rollouts catch up first
                await bus.publish_weights(
                    self.backend.version, self.backend.state_dict_for_publish()
                )
            while self.backend.version < cfg.trainer.steps:
                started = time.monotonic()
                async with bus.take(
                    "train",
                    batch_size=size,
                    min_rows=size,
                    whole_groups=True,
                    columns=list(columns),
                    wait=5.0,
                ) as batch:
                    if not batch.rows:
                        continue
                    # A fixed order (group, then uid) makes a step independent of the order
                    # rows reached the bus: the same samples always give the same update.
                    ordered = sorted(batch.rows, key=lambda r: (r["group"], r["uid"]))
                    rows = [train_row(r, columns) for r in ordered]
                    versions = [r["version"] for r in batch.rows]
                    # Off the event loop: heartbeats must keep flowing during a long step.
                    result = await asyncio.to_thread(
                        self.backend.step, [r for r in rows if r["response_ids"]]
                    )
                    record = {
                        "step": self.backend.version,
                        "applied": result.applied,
                        "skipped_reason": result.skipped_reason,
                        "trainer_version_at_take": batch.trainer_version,
                        "oldest_row_version": min(versions),
                        "newest_row_version": max(versions),
                        "wall_s": time.monotonic() - started,
                        **result.metrics,
                    }
                    self._record(record)
                    batch.skipped_step = not result.applied
                    if result.applied:
                        await bus.publish_weights(
                            self.backend.version, self.backend.state_dict_for_publish(), ack=batch
                        )
                        every = cfg.checkpoint.every_steps
                        if every and self.backend.version % every == 0:
                            await asyncio.to_thread(self._checkpoint)

    def _record(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.log.info(
            "step",
            **{k: record[k] for k in ("step", "applied") if k in record},
            reward=record.get("reward_mean"),
        )

    def _checkpoint(self) -> None:
        target = self._checkpoints() / f"step-{self.backend.version:08d}"
        self.backend.save_checkpoint(target)
        keep = self.cfg.checkpoint.keep_last
        old = sorted(self._checkpoints().glob("step-*"))
        for stale in old[:-keep] if keep else []:
            shutil.rmtree(stale, ignore_errors=True)
