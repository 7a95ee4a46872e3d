"""The evaluator: the policy's score on held-out prompts while it trains (``[eval]``).

The evaluator is a child of its own (``eval``) with its own engine. It follows the weights the
trainer publishes — as a rollout does, long-polling the weights channel — and evaluates
version v when ``v % every_steps == 0`` or v is the final version (``trainer.steps``). It never
holds training up: it takes no samples and admits nothing, so the trainer never waits for it.
Versions published while it evaluates are not queued: the next poll returns only the newest,
and every due version passed over is counted (``eval/skipped_versions``) and logged.

An evaluation generates ``samples_per_prompt`` (k) answers to each of the first ``n_prompts``
held-out prompts (``[eval.data]``, the ``[data]`` machinery with its own seed), scores them with
the run's ``[reward]`` functions and records one metric record: ``eval/mean_reward``,
``eval/pass@1`` and ``eval/pass@k`` (the unbiased estimator, ``relax.algos.pass_at_k``; correct
means reward ≥ ``pass_threshold``), keyed by ``version`` and ``step`` (equal: version v is the
policy after step v). Records go to ``RUN_DIR/eval.jsonl`` and, with ``[logging] tensorboard``,
to ``tensorboard/eval/``.

The end of the run: when the trainer ends, the tree stops its children, the evaluator among
them. Its ``on_stop`` evaluates the newest published version if it has not been evaluated
yet (the run's final policy), within the evaluator's ``shutdown`` seconds — the supervisor
waits that long and then kills it, and the final record is then missing.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from relax.actors import Actor
from relax.algos import mean_pass_at_k
from relax.engines import GenerationEngine, SamplingParams, open_engine
from relax.models import load_tokenizer, stop_token_ids
from relax.observe import (
    EVAL_FILE,
    EVAL_TENSORBOARD_DIR,
    JsonlSink,
    MetricsFanout,
    MetricsSink,
    TensorBoardSink,
)
from relax.rewards import RewardSet
from relax.roles._common import as_list, cluster_config, connect_bus, prompt_seed
from relax.roles._prompts import prompt_row, prompt_stream
from relax.roles._reward import score_rows
from relax.roles._rollout import sample_rows, stop_at_strings
from relax.schema import PROMPT_IDS


def due(version: int, every: int, final: int) -> bool:
    """Whether ``version`` is evaluated: a multiple of ``every``, or the final version."""
    return version % every == 0 or version == final


def passed_over(last: int, version: int, every: int) -> int:
    """How many multiples of ``every`` lie strictly between ``last`` and ``version``: the due
    versions an evaluator that went from ``last`` to ``version`` never evaluated."""
    if version <= last + 1:
        return 0
    return max(0, (version - 1) // every - last // every)


def eval_metrics(rewards: list[float | None], k: int, threshold: float) -> dict[str, float]:
    """Mean reward, pass@1 and pass@k of ``rewards`` (``k`` consecutive samples per prompt;
    ``None`` for a sample whose reward failed: it counts as wrong and is left out of the mean)."""
    scored = [r for r in rewards if r is not None]
    counts = []
    for start in range(0, len(rewards), k):
        group = rewards[start : start + k]
        counts.append((len(group), sum(r is not None and r >= threshold for r in group)))
    return {
        "eval/mean_reward": sum(scored) / len(scored) if scored else float("nan"),
        "eval/pass@1": mean_pass_at_k(counts, 1),
        "eval/pass@k": mean_pass_at_k(counts, k),
        "eval/k": float(k),
        "eval/samples": float(len(rewards)),
        "eval/failed_rewards": float(len(rewards) - len(scored)),
    }


class EvalRole(Actor):
    """Evaluates published policy versions on held-out prompts (see the module docstring)."""

    def __init__(
        self, *, config: dict[str, Any], samples_url: str, model_dir: str, run_dir: str
    ) -> None:
        self.cfg = cluster_config(config)
        self.samples_url, self.model_dir = samples_url, model_dir
        self.run_dir = Path(run_dir)
        self.engine: GenerationEngine | None = None
        self.evaluated = -1  # the newest version evaluated
        self.seen = -1  # the newest version polled
        self.skipped = 0
        self.history: list[dict[str, Any]] = []
        self._sinks: MetricsFanout | None = None
        self._busy = asyncio.Lock()  # one evaluation at a time (run loop or on_stop)

    async def on_start(self) -> None:
        cfg = self.cfg
        # Never interruptible: an evaluation must see exactly one version.
        rollout = cfg.rollout.model_copy(update={"interruptible": False})
        self.engine = await asyncio.to_thread(
            open_engine, rollout, self.model_dir, cfg.model.dtype, lora=cfg.model.lora
        )
        self.tokenizer = getattr(self.engine, "tokenizer", None) or load_tokenizer(self.model_dir)
        self.rewards = RewardSet.from_config(
            cfg.reward,
            answer_key=cfg.eval.data.answer_key,
            max_response_tokens=self._max_new_tokens(),
        )
        await asyncio.to_thread(self.rewards.load)  # e.g. a reward model, as the reward role does
        self.prompts = self._held_out_prompts()
        self._sinks = MetricsFanout(self._build_sinks(), self.log)

    def _max_new_tokens(self) -> int:
        return self.cfg.eval.max_new_tokens or self.cfg.rollout.max_new_tokens

    def _held_out_prompts(self) -> list[dict[str, Any]]:
        """The first ``n_prompts`` usable prompts of ``[eval.data]``, as prompt rows (a file
        with fewer gives each of its prompts once: its stream's first epoch)."""
        data = self.cfg.eval.data
        rows: list[dict[str, Any]] = []
        for item in prompt_stream(data.model_dump()):
            if data.source == "path" and not str(item["id"]).endswith("@0"):
                break  # the file's second epoch: every record was seen
            row = prompt_row(item, self.tokenizer, data.max_prompt_tokens)
            if row is not None:
                rows.append(row)
            if len(rows) == self.cfg.eval.n_prompts:
                return rows
        if not rows:
            raise ValueError("eval.data: no prompt within data.max_prompt_tokens")
        return rows

    def _build_sinks(self) -> list[MetricsSink]:
        sinks: list[MetricsSink] = []
        if self.cfg.logging.jsonl:
            sinks.append(JsonlSink(self.run_dir / EVAL_FILE))
        if self.cfg.logging.tensorboard:
            try:
                sinks.append(TensorBoardSink(self.run_dir / EVAL_TENSORBOARD_DIR))
            except Exception as exc:  # a sink never stops the run (as for the trainer)
                self.log.warning("eval TensorBoard sink unavailable", error=str(exc))
        return sinks

    def statistics(self) -> dict[str, Any]:
        """The newest evaluated version, the versions passed over, and the last record."""
        return {
            "evaluated": self.evaluated,
            "skipped_versions": self.skipped,
            "last": self.history[-1] if self.history else None,
        }

    async def run(self) -> None:
        every, final = self.cfg.eval.every_steps, self.cfg.trainer.steps
        async with await connect_bus(self.samples_url, self.cfg, "eval-weights") as bus:
            # A resumed run: the current version first; nothing published: the model folder,
            # version 0.
            got = await bus.poll_weights(after=-1, wait=0.0)
            self.seen = got[0] if got else 0
            if due(self.seen, every, final):
                await self._evaluate(self.seen, got[1] if got else None)
            while True:
                got = await bus.poll_weights(after=self.seen, wait=30.0)
                if got is None:
                    continue
                self.seen = got[0]
                # A version that is not due is not even loaded (the next due one replaces it).
                if due(got[0], every, final):
                    await self._evaluate(*got)

    async def on_stop(self) -> None:
        try:
            await self._final()
        except Exception as exc:  # the runtime would drop it silently on a shutdown: say it
            self.log.error("final evaluation failed", error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if self._sinks is not None:
                self._sinks.close()
            if self.engine is not None:
                await self.engine.close()

    async def _final(self) -> None:
        """Evaluate the newest published version unless it was (the run's final policy)."""
        if self.engine is None or self._sinks is None:
            return  # never started
        async with await connect_bus(self.samples_url, self.cfg, "eval-final") as bus:
            got = await bus.poll_weights(after=self.evaluated, wait=0.0)
        if got is not None:
            await self._evaluate(*got)
        elif self.evaluated < 0:  # stopped before even version 0 was evaluated
            await self._evaluate(0, None)

    async def _evaluate(self, version: int, weights: dict[str, Any] | None) -> None:
        """Load ``weights`` as ``version`` (``None``: the engine's own, the model folder's) and
        evaluate them into one record."""
        assert self.engine is not None and self._sinks is not None
        async with self._busy:
            if version <= self.evaluated:
                return
            if weights is not None and version > self.engine.version:
                await self.engine.load_weights(version, weights)
            missed = passed_over(self.evaluated, version, self.cfg.eval.every_steps)
            if missed:
                self.skipped += missed
                self.log.warning(
                    "evaluator fell behind: due versions skipped",
                    skipped=missed,
                    evaluating=version,
                )
            started = time.time()
            rewards = await self._score(version)
            record = {
                "step": version,
                "version": version,
                **eval_metrics(rewards, self._k(), self.cfg.eval.pass_threshold),
                "eval/skipped_versions": float(self.skipped),
                "eval/wall_s": time.time() - started,
                "started": started,
                "time": time.time(),
            }
            self.evaluated = version
            self.history.append(record)
            self._sinks.write(record)
            self.log.info(
                "evaluated",
                version=version,
                mean_reward=record["eval/mean_reward"],
                pass_at_k=record["eval/pass@k"],
            )

    def _k(self) -> int:
        return self.cfg.eval.samples_per_prompt

    async def _score(self, version: int) -> list[float | None]:
        """Generate k answers per held-out prompt with the weights of ``version`` and score them."""
        assert self.engine is not None
        ev, engine = self.cfg.eval, self.engine
        if engine.version != version:
            raise RuntimeError(f"evaluator serves version {engine.version}, not {version}")
        params = SamplingParams(
            max_new_tokens=self._max_new_tokens(),
            temperature=0.0 if ev.greedy else ev.temperature,
            top_p=1.0 if ev.greedy else self.cfg.rollout.top_p,
            top_k=0 if ev.greedy else self.cfg.rollout.top_k,
            stop_token_ids=tuple(stop_token_ids(self.tokenizer)),
            n=self._k(),
        )
        gens = await engine.generate(
            [as_list(r["columns"][PROMPT_IDS]) for r in self.prompts],
            params,
            seeds=[prompt_seed(ev.seed, r["uid"]) for r in self.prompts],
        )
        if self.cfg.rollout.stop:  # answers end where the rollout's would
            gens = [stop_at_strings(g, self.tokenizer, self.cfg.rollout.stop) for g in gens]
        rows = sample_rows(self.prompts, gens, self._k())
        results = await score_rows(self.rewards, self.tokenizer, rows, ev.data.answer_key)
        return [float(r.reward) if r.ok and r.reward is not None else None for r in results]


__all__ = ["EVAL_FILE", "EVAL_TENSORBOARD_DIR", "EvalRole", "due", "eval_metrics", "passed_over"]
