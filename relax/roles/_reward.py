"""The reward role: scores generated samples; a sample whose reward fails is dropped, with its
group, and never trained on.

Each reward function gets the whole sample (``relax.rewards.Sample``: response text and ids,
prompt text and messages, the dataset row's fields, uid, group); a batched one gets the whole
batch the role took (``[reward] batch_size``). Named component scores are written with the
reward as ``reward_components`` (the trainer logs their means).

A circuit breaker: a reward that fails group after group is broken, not unlucky. After
``[reward] max_failed_groups`` failed groups in a row the role raises ``RewardFailing`` (from
the function's last exception, so the user sees their own traceback), which stops the run
(``Unrecoverable``: no restart). Until then, repeated identical warnings are rate-limited.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relax.actors import Actor
from relax.errors import RewardFailing
from relax.models import load_tokenizer
from relax.rewards import RewardResult, RewardSet, Sample
from relax.roles._common import (
    as_list,
    client_name,
    cluster_config,
    connect_bus,
    without_poisoned,
)
from relax.schema import PROMPT_IDS, RESPONSE_IDS, REWARD

REWARD_INPUTS = ("prompt_ids", "prompt_text", "messages", "fields")
"""Optional sample-row columns a reward sample is built from (see ``_rollout.PROMPT_FOR_REWARD``),
besides the required ``response_ids`` and ``answer``."""


def reward_sample(row: Mapping[str, Any], tokenizer: Any, answer_key: str = "answer") -> Sample:
    """The ``Sample`` a reward function sees for one sample-bus row."""
    cols = row["columns"]
    ids = as_list(cols[RESPONSE_IDS])
    fields = cols.get("fields")
    fields = dict(fields) if isinstance(fields, Mapping) else {}
    # The reference with its JSON type when the row has it (a dict answer is a dict); the
    # string form the dataset always puts on the row otherwise.
    answer = fields.get(answer_key)
    if answer is None:
        answer = cols.get("answer")
    prompt_ids = cols.get(PROMPT_IDS)
    return Sample(
        response=tokenizer.decode(ids, skip_special_tokens=True),
        answer=answer,
        fields=fields,
        prompt=cols.get("prompt_text") or "",
        messages=cols.get("messages"),
        prompt_ids=[] if prompt_ids is None else as_list(prompt_ids),
        response_ids=ids,
        response_tokens=len(ids),
        uid=str(row.get("uid", "")),
        group=str(row.get("group", "")),
    )


async def score_rows(
    rewards: RewardSet,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    answer_key: str = "answer",
) -> list[RewardResult]:
    """Score sample-bus rows together (batched functions get them in one call)."""
    return await rewards.score_batch([reward_sample(r, tokenizer, answer_key) for r in rows])


def reward_columns(result: RewardResult) -> dict[str, Any]:
    """The columns a scored sample gets: ``reward`` and its named ``reward_components``."""
    assert result.ok and result.reward is not None
    return {REWARD: float(result.reward), "reward_components": dict(result.components)}


def component_metrics(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``reward/<component>``: the mean of each named reward component over the rows that
    have it (what the trainer logs per step beside ``reward_mean``)."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        parts = row.get("columns", {}).get("reward_components")
        if not isinstance(parts, Mapping):
            continue
        for name, value in parts.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total = sums.setdefault(str(name), [0.0, 0])
                total[0] += float(value)
                total[1] += 1
    return {f"reward/{name}": total / count for name, (total, count) in sorted(sums.items())}


class WarningThrottle:
    """Rate-limits a flood of warnings: each distinct ``key`` is warned about the first time,
    then at most once per ``interval`` seconds with ``repeated`` (how many were held back); at
    most ``burst`` distinct new keys are warned about per interval, the rest counted and
    reported with the next warning (``not_logged``).

    A held-back warning is not lost: it goes out at debug level (``held_back=True``), so a run
    at ``logging.level = "debug"`` names every failed sample while the warnings a person reads
    stay few. (The reward circuit breaker bounds how many there can be in a row.)"""

    def __init__(
        self,
        log: Any,
        *,
        interval: float = 30.0,
        burst: int = 10,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.interval, self.burst, self.max_keys = log, interval, burst, max_keys
        self.clock = clock
        self._seen: dict[str, list[float]] = {}  # key -> [last logged at, held back since]
        self._window, self._new_in_window, self._unlogged = -math.inf, 0, 0

    def warning(self, key: str, event: str, **fields: Any) -> bool:
        """Log ``event`` unless held back; True when it was logged."""
        now = self.clock()
        if now - self._window >= self.interval:
            self._window, self._new_in_window = now, 0
        entry = self._seen.get(key)
        if entry is None:
            if self._new_in_window >= self.burst:
                self._unlogged += 1
                self._hold_back(event, fields)
                return False
            self._new_in_window += 1
            if len(self._seen) >= self.max_keys:
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = [now, 0]
            self._emit(event, fields)
            return True
        if now - entry[0] < self.interval:
            entry[1] += 1
            self._hold_back(event, fields)
            return False
        fields["repeated"] = int(entry[1])
        entry[:] = [now, 0]
        self._emit(event, fields)
        return True

    def _hold_back(self, event: str, fields: dict[str, Any]) -> None:
        self.log.debug(event, held_back=True, **fields)

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        if self._unlogged:
            fields["not_logged"], self._unlogged = self._unlogged, 0
        self.log.warning(event, **fields)


class CircuitBreaker:
    """Counts consecutive failed groups; ``trip`` says when there were ``limit`` of them (a
    limit of 0 never trips). A group fails when any of its samples' reward failed; a group
    scored whole resets the count."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.last: tuple[str, RewardResult] | None = None  # (uid, result) of the last failure

    def record(self, rows: Sequence[Mapping[str, Any]], results: Sequence[RewardResult]) -> None:
        failed: dict[str, tuple[str, RewardResult] | None] = {}
        for row, result in zip(rows, results, strict=True):
            if not result.ok:
                failed[row["group"]] = (row["uid"], result)
            else:
                failed.setdefault(row["group"], None)
        for failure in failed.values():  # groups in the order they came
            if failure is None:
                self.in_a_row = 0
            else:
                self.in_a_row += 1
                self.last = failure

    @property
    def tripped(self) -> bool:
        return self.limit > 0 and self.in_a_row >= self.limit

    def error(self) -> RewardFailing:
        """The error that stops the run, raised from the function's last exception."""
        assert self.last is not None
        uid, result = self.last
        exc = RewardFailing(
            f"the reward failed for {self.in_a_row} groups in a row"
            f" (reward.max_failed_groups = {self.limit}), so the run stops; the last failure"
            f" (sample {uid}): {result.reason}",
            failed_groups=self.in_a_row,
        )
        cause = next(iter(result.errors.values()), None)
        exc.__cause__ = cause
        return exc


class Scorer:
    """Scores sample rows the one way they are scored, wherever that runs: in the reward role,
    or in the rollout that generated them (``[reward] in_rollout``). Holds the reward set, the
    circuit breaker and the throttled warnings about failed samples."""

    def __init__(self, cfg: Any, tokenizer: Any, log: Any) -> None:
        self.rewards = RewardSet.from_config(
            cfg.reward, answer_key="answer", max_response_tokens=cfg.rollout.max_new_tokens
        )
        self.tokenizer, self.answer_key = tokenizer, cfg.data.answer_key
        self.breaker = CircuitBreaker(cfg.reward.max_failed_groups)
        self.throttle = WarningThrottle(log)
        self.failed = 0

    async def load(self) -> None:
        """Model-backed functions load their weights once per process, off the loop (so
        heartbeats go on) and before the first batch (so loading never counts against a
        call's timeout)."""
        if self.rewards.loads:
            await asyncio.to_thread(self.rewards.load)

    async def score(
        self, rows: Sequence[Mapping[str, Any]]
    ) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
        """The reward columns of each row scored, as ``(uid, columns)``, and the uids whose
        reward failed (counted, warned about: their groups are to be dropped). The rows are
        scored concurrently (slow verifiers overlap, a batched one gets them whole)."""
        results = await score_rows(self.rewards, self.tokenizer, rows, self.answer_key)
        self.breaker.record(rows, results)
        scored, failed = [], []
        for row, result in zip(rows, results, strict=True):
            if result.ok:
                scored.append((row["uid"], reward_columns(result)))
                continue
            self.failed += 1
            self.throttle.warning(
                str(result.reason),
                "reward failed; the sample's group is dropped",
                uid=row["uid"],
                group=row["group"],
                reason=result.reason,
                failures=result.failures,
            )
            failed.append(row["uid"])
        return scored, failed

    def check(self) -> None:
        """Raise ``RewardFailing`` once ``[reward] max_failed_groups`` groups in a row failed
        (call it after the batch's drops and rewards are on the bus)."""
        if self.breaker.tripped:
            raise self.breaker.error()

    def statistics(self) -> dict[str, Any]:
        return {
            "failed": self.failed,
            "failed_groups_in_a_row": self.breaker.in_a_row,
            **self.rewards.statistics(),
        }


class RewardRole(Actor):
    def __init__(self, *, config: dict[str, Any], samples_url: str, model_dir: str) -> None:
        self.cfg = cluster_config(config)
        self.samples_url, self.model_dir = samples_url, model_dir

    def statistics(self) -> dict[str, Any]:
        return self.scorer.statistics()

    async def on_start(self) -> None:
        self.scorer = Scorer(self.cfg, load_tokenizer(self.model_dir), self.log)
        await self.scorer.load()

    async def run(self) -> None:
        async with await connect_bus(self.samples_url, self.cfg, client_name(self.context)) as bus:
            while True:
                async with bus.take(
                    "reward",
                    batch_size=self.cfg.reward.batch_size,
                    columns=[RESPONSE_IDS, "answer"],
                    optional=list(REWARD_INPUTS),
                    wait=1.0,
                ) as batch:
                    await without_poisoned(bus, batch, self.log)  # e.g. a string response_ids
                    # Scored together, written back in one request.
                    scored, failed = await self.scorer.score(batch.rows)
                    batch.drop(failed, "reward_failed")
                    refused = await bus.add_columns_many(scored)
                    for (uid, _), error in zip(scored, refused, strict=True):
                        if error is not None:  # e.g. its group was dropped meanwhile
                            self.log.info(
                                "reward not written",
                                uid=uid,
                                error=f"{type(error).__name__}: {error}",
                            )
                self.scorer.check()  # after the batch's drops and rewards are on the bus
