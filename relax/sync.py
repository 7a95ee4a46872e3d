"""A strictly synchronous run: the reference the asynchronous cluster is measured against.

One loop in one process, no actors and no bus: take the next prompts, generate, score, train,
load the new weights, repeat. It uses the very pieces the roles use — the prompt stream and
encoding, the engine with per-prompt seeds, the reward set, the training backend, the
trainer's row order — so a cluster run with ``staleness = 0`` must give *identical* results
(the same rewards, losses and final weights, bit for bit); ``tests/e2e/test_sync.py`` holds
the two to that. Useful on its own for debugging a recipe without any concurrency
(``relax up CONFIG --sync``).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

from relax.cluster import Layout, prepare
from relax.config import ClusterConfig
from relax.engines import open_engine
from relax.log import get_logger
from relax.models import OMNI_ARCHS, load_tokenizer, stop_token_ids
from relax.rewards import RewardSet
from relax.roles import generate_groups, prompt_row, prompt_stream, sample_rows, score_rows
from relax.schema import LOGPROBS, PROMPT_IDS, RESPONSE_IDS, REWARD
from relax.training import build_backend, checkpoint_name


async def run_sync(cfg: ClusterConfig, run_dir: str | Path | None = None) -> Layout:
    """Train ``trainer.steps`` steps synchronously; writes ``metrics.jsonl`` and a final
    checkpoint (``checkpoints/step-N``) in the run folder, like a cluster run."""
    if cfg.reference.enabled or cfg.critic.enabled:
        raise NotImplementedError("the synchronous runner has no reference or critic model yet")
    if cfg.rollout.agent.kind != "single":
        raise NotImplementedError(
            "the synchronous runner plays single replies only; run agent kinds as a cluster"
        )
    if cfg.model.init is not None and cfg.model.init.arch in OMNI_ARCHS:
        raise NotImplementedError("the synchronous runner has no media path yet; run a cluster")
    layout = prepare(cfg, run_dir)
    tokenizer = load_tokenizer(layout.model_dir)
    rollout = cfg.rollout.model_copy(update={"interruptible": False})
    engine = open_engine(rollout, layout.model_dir, cfg.model.dtype, lora=cfg.model.lora)
    rewards = RewardSet.from_config(
        cfg.reward, answer_key="answer", max_response_tokens=cfg.rollout.max_new_tokens
    )
    backend = build_backend(cfg, str(layout.model_dir))  # as the cluster's trainer starts
    if cfg.trainer.gang > 1:
        # The same rows and the same update, accumulated in one process: a gang's all-reduced
        # sums differ from it in the last bits, so the gang's run is not this one bit for bit.
        get_logger().warning(
            "the synchronous run trains the gang's batch in one process",
            gang=cfg.trainer.gang,
            micro_batches=cfg.trainer.global_batch_size // cfg.trainer.micro_batch_size,
        )
    n = cfg.data.n_samples_per_prompt
    groups_per_step = cfg.trainer.global_batch_size // n
    stops = stop_token_ids(tokenizer)
    stream = prompt_stream(cfg.data.model_dump())
    metrics_file = layout.run_dir / "metrics.jsonl"
    try:
        while backend.version < cfg.trainer.steps:
            started = time.monotonic()
            rows: list[dict[str, Any]] = []
            while len(rows) < cfg.trainer.global_batch_size:
                wanted = min(cfg.rollout.batch_size, groups_per_step - len(rows) // n)
                encoded = (
                    prompt_row(item, tokenizer, cfg.data.max_prompt_tokens) for item in stream
                )
                prompts = list(itertools.islice((p for p in encoded if p is not None), wanted))
                rows += await _generate_and_score(cfg, engine, rewards, tokenizer, prompts, stops)
            rows.sort(key=lambda r: (r["group"], r["uid"]))  # the trainer role's order
            version = engine.version
            result = backend.step([r for r in rows if r[RESPONSE_IDS]])
            record = {
                "step": backend.version,
                "applied": result.applied,
                "skipped_reason": result.skipped_reason,
                "trainer_version_at_take": version,
                "oldest_row_version": version,
                "newest_row_version": version,
                "staleness_max": 0,
                "wall_s": time.monotonic() - started,
                **result.metrics,
            }
            with metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if result.applied:
                await engine.load_weights(backend.version, backend.state_dict_for_publish())
        checkpoint = layout.run_dir / cfg.checkpoint.dir / checkpoint_name(backend.version)
        backend.save_checkpoint(checkpoint)
    finally:
        await engine.close()
    return layout


async def _generate_and_score(
    cfg: ClusterConfig,
    engine: Any,
    rewards: RewardSet,
    tokenizer: Any,
    prompts: list[dict[str, Any]],
    stops: list[int],
) -> list[dict[str, Any]]:
    """Sample each prompt's group and score it; a group with a failed reward is dropped whole,
    as the reward role drops it."""
    n = cfg.data.n_samples_per_prompt
    gens = await generate_groups(engine, cfg, prompts, stops)
    rows = []
    for i, prompt in enumerate(prompts):
        # The very sample rows the rollout puts on the bus, scored as the reward role scores.
        samples = sample_rows([prompt], gens[i * n : (i + 1) * n], n)
        results = await score_rows(rewards, tokenizer, samples, cfg.data.answer_key)
        if not all(result.ok for result in results):
            continue
        for sample, result in zip(samples, results, strict=True):
            c = sample["columns"]
            rows.append(
                {
                    "uid": sample["uid"],
                    "group": sample["group"],
                    PROMPT_IDS: c[PROMPT_IDS],
                    RESPONSE_IDS: c[RESPONSE_IDS],
                    LOGPROBS: c[LOGPROBS],
                    REWARD: float(result.reward),
                }
            )
    return rows
