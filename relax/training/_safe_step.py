"""The step every training backend shares: advantages, micro-batched losses, safe skips."""

from __future__ import annotations

import abc
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from relax.algos import dynamic_sampling_mask
from relax.config import AlgorithmConfig, TrainerConfig
from relax.models import ReplayStats, routing
from relax.training._base import StepResult, TrainingBackend
from relax.training._batch import Batch, Row, pack_batch
from relax.training._logprobs import forward_logprobs
from relax.training._objective import (
    COUNT_PREFIX,
    aggregation,
    check_supported,
    compute_advantages,
    correct_batch,
    correction_spec,
    loss_denominator,
    micro_batch_loss,
)

log = logging.getLogger("relax.training")

MAX_METRICS = frozenset({"ratio_max", "mismatch_max", "is_weight_max"})
"""Metrics that are maxima over micro-batches (and ranks) rather than weighted means."""


def _non_finite_inputs(batch: Batch) -> str | None:
    """Describe the first non-finite reward or counted per-token input, or ``None``."""
    bad_rows = (~torch.isfinite(batch.rewards)).nonzero().flatten().tolist()
    if bad_rows:
        return f"non-finite reward in rows {bad_rows}"
    for name in ("rollout_logprobs", "ref_logprobs", "values"):
        tensor = getattr(batch, name)
        if tensor is None:
            continue
        bad = (batch.mask > 0) & ~torch.isfinite(tensor)
        if bad.any():
            return f"non-finite {name} in rows {bad.any(dim=-1).nonzero().flatten().tolist()}"
    return None


class SafeStepBackend(TrainingBackend):
    """The step every backend shares: advantages, micro-batched losses, safe skips.

    ``step(rows)`` packs the rows, drops zero-signal groups when ``dynamic_sampling`` is on,
    computes advantages over the whole batch, then runs forward/backward in micro-batches of
    ``trainer.micro_batch_size`` rows and takes the global gradient norm *before* any update.
    A non-finite loss or gradient norm, or a norm above ``trainer.max_grad_norm_skip``, skips
    the step: gradients are dropped and weights and optimiser state stay bit-identical.

    Subclasses say how gradients are made, measured, applied and dropped (the hooks below);
    a data-parallel backend also says which micro-batches this rank runs and how the ranks'
    metrics combine.
    """

    runs_every_micro_batch = False
    """True when every scheduled micro-batch must run forward/backward, even one that counts
    for nothing or holds a non-finite loss (data-parallel ranks must stay in step)."""

    def __init__(
        self,
        trainer_config: TrainerConfig,
        algorithm_config: AlgorithmConfig,
        *,
        pad_id: int,
        temperature: float,
    ) -> None:
        """Refuses an ``[algorithm]`` the step cannot run; starts at version 0, no skips.

        ``temperature`` must match the rollout's sampling temperature (1.0 for RL).
        """
        check_supported(algorithm_config)
        self.trainer_config = trainer_config
        self.algorithm_config = algorithm_config
        self.pad_id = pad_id
        # Greedy rollouts (temperature 0) give log-probs of the untempered model.
        self.temperature = temperature if temperature > 0 else 1.0
        self._version = 0
        self.skipped_steps = 0

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ hooks

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the batch tensors go."""

    @abc.abstractmethod
    def _forward_module(self) -> torch.nn.Module:
        """What scores a micro-batch (the model, or the engine wrapping it)."""

    def _clear_gradients(self) -> None:
        """Start a step with no gradient anywhere."""

    @abc.abstractmethod
    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate the gradient of ``loss``; ``last`` marks the step's final micro-batch."""

    @abc.abstractmethod
    def _global_grad_norm(self) -> float:
        """The L2 norm of the whole accumulated gradient (over every rank), before clipping."""

    @abc.abstractmethod
    def _apply_update(self, grad_norm: float) -> None:
        """Clip to ``trainer.grad_clip`` and take the optimiser step."""

    @abc.abstractmethod
    def _finish_step(self, applied: bool) -> None:
        """Drop whatever gradient is left; after a skip nothing may reach the next step."""

    @abc.abstractmethod
    def _lr(self) -> float:
        """The current learning rate."""

    def _micro_batch_schedule(self, count: int) -> list[int | None]:
        """Indices of the micro-batches this rank runs, in order; ``None`` is a stand-in
        that only keeps data-parallel ranks in step (its loss is weighted 0)."""
        return list(range(count))

    def _loss_scale(self) -> float:
        """Factor on every micro-batch loss (a data-parallel mean over N ranks needs N)."""
        return 1.0

    def _combine(
        self, sums: dict[str, float], problem: str | None
    ) -> tuple[dict[str, float], str | None]:
        """Merge the metric sums and loss problems of every rank (one rank: as they are)."""
        return sums, problem

    def _extra_metrics(self) -> dict[str, float]:
        """Backend-specific metrics added to every step's."""
        return {}

    @property
    def is_main(self) -> bool:
        """Whether this rank logs (rank 0 of a data-parallel world)."""
        return True

    # ------------------------------------------------------------------ the step

    def compute_gradients(self, rows: Sequence[Row]) -> tuple[dict[str, float], str | None]:
        """Forward/backward over ``rows``, leaving the gradient accumulated; no update.

        Returns ``(metrics, problem)``: ``problem`` names why the step must not be applied
        (empty batch, non-finite loss), else ``None``. Exposed for gradient checks in tests.
        """
        cfg = self.algorithm_config
        self._clear_gradients()
        batch = pack_batch(rows, self.pad_id).to(self.device)
        metrics: dict[str, float] = {"rows": float(batch.size)}
        bad = _non_finite_inputs(batch)
        if bad is not None:
            # Advantage estimators may quietly map a NaN reward to a zero advantage; a poisoned
            # input is a bug upstream, so refuse the whole batch and say where it is.
            return metrics, bad
        if cfg.dynamic_sampling:
            keep = dynamic_sampling_mask(batch.rewards, batch.group_ids).tolist()
            metrics["dropped_rows"] = float(keep.count(False))
            if not all(keep):
                kept = [row for row, k in zip(rows, keep, strict=True) if k]
                if not kept:
                    return metrics, "every group has zero reward variance (dynamic sampling)"
                batch = pack_batch(kept, self.pad_id).to(self.device)

        advantages, adv_metrics = compute_advantages(batch, cfg)
        metrics.update({k: v.item() for k, v in adv_metrics.items()})
        agg = aggregation(cfg)
        metrics["tokens"] = float(batch.num_tokens)
        if batch.num_tokens == 0:
            return metrics, "no response tokens count in the loss"
        weights = None
        if correction_spec(cfg).needs_whole_batch:
            # Dropped tokens leave the denominators, and a batch mean of the weights needs
            # every row: both are settled here, once, before any micro-batch's loss.
            batch, weights, fixed = correct_batch(batch, self._score(batch), cfg)
            metrics.update({k: v.item() for k, v in fixed.items()})
            if batch.num_tokens == 0:
                return metrics, "the rollout correction rejected every token"
        total = loss_denominator(batch.mask, agg)

        sums: dict[str, float] = {}
        problem: str | None = None
        micro = self.trainer_config.micro_batch_size
        if self.trainer_config.sort_micro_batches and batch.size > micro:
            # Each micro-batch is trimmed to its longest row (``Batch.select``): rows of similar
            # length together leave little padding to compute. Longest first: the memory peak
            # comes at once. Every rank of a gang sorts the same way.
            order = torch.sort(batch.lengths.cpu(), descending=True, stable=True).indices
            batch = batch.reordered(order)
            advantages = advantages[order.to(advantages.device)]
            if weights is not None:
                weights = weights[order.to(weights.device)]
        scale = self._loss_scale()
        # Entropy is always reported; it only needs a graph when it is part of the loss.
        entropy_in_loss = cfg.entropy_coef > 0
        schedule = self._micro_batch_schedule(-(-batch.size // micro))
        for position, index in enumerate(schedule):
            stand_in = index is None
            start = 0 if index is None else index * micro
            mb = batch.select(start, min(start + micro, batch.size))
            weight = loss_denominator(mb.mask, agg) / total
            if stand_in:
                weight = torch.zeros_like(weight)
            idle = weight.item() == 0 or mb.num_tokens == 0
            if idle and not self.runs_every_micro_batch:
                continue  # nothing counted here: its loss and gradient are exactly zero
            with self._routing(mb, aux_loss=True) as route:
                logprobs, entropy = forward_logprobs(
                    self._forward_module(),
                    mb,
                    self.temperature,
                    with_entropy=True,
                    entropy_grad=entropy_in_loss,
                )
            mb_adv = advantages[start : start + mb.size]
            if mb_adv.dim() == 2:
                mb_adv = mb_adv[:, : mb.mask.shape[1]]
            mb_weights = None
            if weights is not None:
                mb_weights = weights[start : start + mb.size, : mb.mask.shape[1]]
            loss, _, mb_metrics = micro_batch_loss(logprobs, entropy, mb, mb_adv, cfg, mb_weights)
            loss = self._with_routing_metrics(loss, mb_metrics, route)
            if not stand_in:
                mb_metrics["loss"] = loss.detach()
                w = weight.item()
                for key, value in mb_metrics.items():
                    if key.startswith(COUNT_PREFIX):
                        continue
                    v = value.item()
                    count = mb_metrics.get(COUNT_PREFIX + key)
                    if key in MAX_METRICS:
                        sums[key] = max(sums.get(key, -math.inf), v)
                    elif count is not None:  # a mean over its own positions: summed as such
                        n = count.item()
                        sums[key] = sums.get(key, 0.0) + n * v
                        sums[COUNT_PREFIX + key] = sums.get(COUNT_PREFIX + key, 0.0) + n
                    else:
                        sums[key] = sums.get(key, 0.0) + w * v
                if problem is None and not math.isfinite(mb_metrics["loss"].item()):
                    problem = f"non-finite loss ({mb_metrics['loss'].item()})"
                    if not self.runs_every_micro_batch:
                        break
            # Ranks that must stay in step run the poisoned micro-batch too: the step is
            # skipped below and its gradient dropped.
            self._backward(loss * (weight * scale), position == len(schedule) - 1)
        sums, problem = self._combine(sums, problem)
        for key in [k for k in sums if k.startswith(COUNT_PREFIX)]:
            count, name = sums.pop(key), key[len(COUNT_PREFIX) :]
            sums[name] = sums[name] / count if count else 0.0
        metrics.update(sums)
        return metrics, problem

    def _score(self, batch: Batch) -> torch.Tensor:
        """The current weights' log-probs ``[batch, seq - 1]`` of every row, without gradient,
        in micro-batches. Every rank scores every row, so data-parallel ranks run the same
        forward passes (ZeRO-3 gathers parameters in lockstep) and agree on the result."""
        out = torch.zeros_like(batch.rollout_logprobs)
        micro = self.trainer_config.micro_batch_size
        with torch.no_grad():
            for start in range(0, batch.size, micro):
                mb = batch.select(start, min(start + micro, batch.size))
                with self._routing(mb):
                    logprobs, _ = forward_logprobs(self._forward_module(), mb, self.temperature)
                out[start : start + mb.size, : logprobs.shape[1]] = logprobs
        return out

    def _routing(self, mb: Batch, *, aux_loss: bool = False) -> Any:
        """The MoE routing of a forward pass over ``mb``: the recorded experts replayed with
        ``[trainer] routing_replay``, disagreement counted, the load-balancing loss computed
        when it has a weight (a no-op for a dense model)."""
        cfg = self.trainer_config
        return routing(
            self._forward_module(),
            mb.routed_experts,
            replay=cfg.routing_replay,
            token_mask=mb.attention_mask,
            aux_loss=aux_loss and cfg.moe_aux_loss_coef > 0,
        )

    def _with_routing_metrics(
        self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], route: ReplayStats
    ) -> torch.Tensor:
        """``loss`` plus the weighted load-balancing loss, and the routing metrics."""
        if route.tokens:
            metrics["router_disagreement"] = torch.tensor(route.disagreement, dtype=torch.float32)
        aux = route.aux_loss
        if aux is None:
            return loss
        metrics["moe_aux_loss"] = aux.detach()
        return loss + self.trainer_config.moe_aux_loss_coef * aux

    def step(self, rows: Sequence[Row]) -> StepResult:
        """One optimiser step on ``rows``; see the class docstring for when it is skipped."""
        started = time.perf_counter()
        metrics, problem = self.compute_gradients(rows)
        gradients_done = time.perf_counter()
        grad_norm = math.nan
        if problem is None:
            grad_norm = self._global_grad_norm()
            skip_above = self.trainer_config.max_grad_norm_skip
            if not math.isfinite(grad_norm):
                problem = f"non-finite grad norm ({grad_norm})"
            elif skip_above is not None and grad_norm > skip_above:
                problem = f"grad norm {grad_norm:.4g} above max_grad_norm_skip {skip_above:g}"
            else:
                self._apply_update(grad_norm)
                self._version += 1
        # Drop gradients either way: a skipped step must leave no trace for the next one.
        self._finish_step(applied=problem is None)
        metrics.update(
            grad_norm=grad_norm,
            version=float(self._version),
            lr=self._lr(),
            step_time_s=time.perf_counter() - started,
            # Where the step's time went: forward/backward, then norm, clipping and optimiser.
            gradient_time_s=gradients_done - started,
            update_time_s=time.perf_counter() - gradients_done,
            skipped=float(problem is not None),
            **self._extra_metrics(),
        )
        if problem is not None:
            self.skipped_steps += 1
            if self.is_main:
                log.warning("training step skipped at version %d: %s", self._version, problem)
            return StepResult(applied=False, metrics=metrics, skipped_reason=problem)
        return StepResult(applied=True, metrics=metrics)
