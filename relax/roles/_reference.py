"""The reference role: scores generated samples under the frozen reference policy.

Takes rows under task ``"reference"`` as soon as they have ``prompt_ids`` and ``response_ids``,
computes each response token's log-prob under the reference model — at the rollout
temperature, with exactly the trainer's alignment (``pack_batch`` + ``sequence_logprobs``) —
and writes them as the ``ref_logprobs`` column (one float per response token). The trainer
waits for that column when ``algorithm.kl.coef > 0``.

The reference is ``reference.model_path``, or else the model the policy starts from (the
run's model folder: the policy at version 0), and is never updated. Forward passes run in a
worker thread (heartbeats keep flowing) in micro-batches of ``trainer.micro_batch_size`` rows,
sorted by length so that little compute goes to padding.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import torch

from relax.actors import Actor
from relax.models import load_policy, routing
from relax.roles._common import (
    client_name,
    cluster_config,
    connect_bus,
    training_row,
    without_poisoned,
    write_once,
)
from relax.schema import (
    LOGPROBS,
    MM_INPUTS,
    PROMPT_IDS,
    REF_LOGPROBS,
    RESPONSE_IDS,
    REWARD,
    ROUTED_EXPERTS,
)
from relax.training import Row, pack_batch, response_values, sequence_logprobs

TAKE_ROWS = 64
"""Most rows one lease takes; they are scored in micro-batches."""


def reference_logprobs(
    model: torch.nn.Module,
    rows: Sequence[Row],
    *,
    pad_id: int,
    temperature: float = 1.0,
    micro_batch_size: int = 16,
    routing_replay: bool = False,
) -> list[list[float]]:
    """Per-token log-probs of each row's ``response_ids`` given its ``prompt_ids`` under ``model``.

    The same numbers the trainer computes for the same model (``pack_batch`` alignment,
    logits divided by ``temperature``); one list per row, as long as its ``response_ids``.
    With ``routing_replay``, a mixture-of-experts model routes every token as the rollout did
    (the rows' ``routed_experts``), as the trainer does (R3).
    """
    order = sorted(
        range(len(rows)), key=lambda i: len(rows[i][PROMPT_IDS]) + len(rows[i][RESPONSE_IDS])
    )
    out: list[list[float]] = [[] for _ in rows]
    device = next(model.parameters()).device
    for start in range(0, len(order), micro_batch_size):
        chunk = order[start : start + micro_batch_size]
        packed = pack_batch(
            [
                {
                    PROMPT_IDS: list(rows[i][PROMPT_IDS]),
                    RESPONSE_IDS: list(rows[i][RESPONSE_IDS]),
                    LOGPROBS: [0.0] * len(rows[i][RESPONSE_IDS]),
                    REWARD: 0.0,
                    "group": i,
                    MM_INPUTS: rows[i].get(MM_INPUTS),
                    ROUTED_EXPERTS: rows[i].get(ROUTED_EXPERTS) if routing_replay else None,
                }
                for i in chunk
            ],
            pad_id,
        )
        on_device = packed.to(device)
        with torch.inference_mode(), routing(model, on_device.routed_experts):
            logprobs = sequence_logprobs(model, on_device, temperature)
        for i, values in zip(chunk, response_values(packed, logprobs.float().cpu()), strict=True):
            out[i] = values
    return out


class ReferenceRole(Actor):
    def __init__(self, *, config: dict[str, Any], samples_url: str, model_dir: str) -> None:
        self.cfg = cluster_config(config)
        self.samples_url, self.model_dir = samples_url, model_dir
        self.scored = 0
        self.batches = 0
        self.already_written = 0
        self.busy_s = 0.0

    def statistics(self) -> dict[str, Any]:
        return {
            "scored": self.scored,
            "batches": self.batches,
            "already_written": self.already_written,
            "busy_s": self.busy_s,
        }

    async def on_start(self) -> None:
        cfg = self.cfg
        path = cfg.reference.model_path or self.model_dir
        # The run's tokenizer: the reference only has to agree with the policy on token ids.
        self.model, tokenizer = await asyncio.to_thread(
            load_policy,
            path,
            cfg.model.dtype,
            tokenizer=self.model_dir,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        self.model.requires_grad_(False)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        # Greedy rollouts give log-probs of the untempered model (as in the trainer).
        temperature = cfg.rollout.temperature
        self.temperature = temperature if temperature > 0 else 1.0

    def _score(self, rows: list[dict[str, Any]]) -> list[list[float]]:
        return reference_logprobs(
            self.model,
            rows,
            pad_id=self.pad_id,
            temperature=self.temperature,
            micro_batch_size=self.cfg.trainer.micro_batch_size,
            routing_replay=self.cfg.trainer.routing_replay,
        )

    async def run(self) -> None:
        async with await connect_bus(self.samples_url, self.cfg, client_name(self.context)) as bus:
            while True:
                async with bus.take(
                    "reference",
                    batch_size=TAKE_ROWS,
                    columns=[PROMPT_IDS, RESPONSE_IDS],
                    optional=[MM_INPUTS, ROUTED_EXPERTS],
                    wait=1.0,
                ) as batch:
                    await without_poisoned(bus, batch, self.log)  # e.g. a string response_ids
                    if not batch.rows:
                        continue
                    started = time.monotonic()
                    rows = [training_row(r, (PROMPT_IDS, RESPONSE_IDS)) for r in batch.rows]
                    # Off the event loop: heartbeats must keep flowing during the forward.
                    scored = await asyncio.to_thread(self._score, rows)
                    self.already_written += await write_once(
                        bus,
                        [
                            (row["uid"], {REF_LOGPROBS: logprobs})
                            for row, logprobs in zip(batch.rows, scored, strict=True)
                        ],
                    )
                    self.scored += len(rows)
                    self.batches += 1
                    self.busy_s += time.monotonic() - started
