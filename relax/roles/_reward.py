"""The reward role: scores generated samples; a sample whose reward fails is dropped, with its
group, and never trained on."""

from __future__ import annotations

import asyncio
from typing import Any

from relax.actors import Actor
from relax.engines import load_tokenizer
from relax.rewards import RewardResult, RewardSet
from relax.roles._common import as_list, cluster_config, connect_bus


async def score_sample(
    rewards: RewardSet, tokenizer: Any, response_ids: list[int], answer: Any
) -> RewardResult:
    """Score one generated response against its prompt's reference answer."""
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    return await rewards.score(text, {"answer": answer}, response_tokens=len(response_ids))


class RewardRole(Actor):
    def __init__(self, *, config: dict[str, Any], samples_url: str, model_dir: str) -> None:
        self.cfg = cluster_config(config)
        self.samples_url, self.model_dir = samples_url, model_dir
        self.failed = 0

    def statistics(self) -> dict[str, Any]:
        return {"failed": self.failed, **self.rewards.statistics()}

    async def on_start(self) -> None:
        self.tokenizer = load_tokenizer(self.model_dir)
        self.rewards = RewardSet.from_config(
            self.cfg.reward,
            answer_key="answer",
            max_response_tokens=self.cfg.rollout.max_new_tokens,
        )

    async def run(self) -> None:
        async with await connect_bus(
            self.samples_url, self.cfg, f"reward-{self.context.rank}"
        ) as bus:
            while True:
                async with bus.take(
                    "reward", batch_size=64, columns=["response_ids", "answer"], wait=1.0
                ) as batch:
                    # The batch is scored concurrently (slow verifiers overlap) and written back
                    # in one request.
                    results = await asyncio.gather(
                        *(
                            score_sample(
                                self.rewards,
                                self.tokenizer,
                                as_list(row["columns"]["response_ids"]),
                                row["columns"]["answer"],
                            )
                            for row in batch.rows
                        )
                    )
                    scored = []
                    for row, result in zip(batch.rows, results, strict=True):
                        if result.ok:
                            scored.append((row["uid"], {"reward": float(result.reward)}))
                            continue
                        self.failed += 1
                        self.log.warning(
                            "reward failed; the sample's group is dropped",
                            uid=row["uid"],
                            group=row["group"],
                            reason=result.reason,
                            failures=result.failures,
                        )
                        batch.drop([row["uid"]], "reward_failed")
                    refused = await bus.add_columns_many(scored)
                    for (uid, _), error in zip(scored, refused, strict=True):
                        if error is not None:  # e.g. its group was dropped meanwhile
                            self.log.info("reward not written", uid=uid, error=error)
