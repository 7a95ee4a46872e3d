"""The interface every optimisation backend (plain torch, DeepSpeed) implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax.training._batch import Row


@dataclass(frozen=True)
class StepResult:
    """What one call to :meth:`TrainingBackend.step` did."""

    applied: bool
    """True when the optimiser updated the weights (and the version went up)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Plain floats for logging: loss, policy_loss, kl, entropy, grad_norm, clip_frac, ..."""
    skipped_reason: str | None = None
    """Why the step was skipped (non-finite loss, exploding grad norm, nothing to train on);
    ``None`` when applied."""


class TrainingBackend(abc.ABC):
    """Owns the policy weights and optimiser; turns batches of scored rows into updates.

    A step is all-or-nothing: either the optimiser applies one update and :attr:`version`
    goes up by one, or nothing about the weights or optimiser state changes and the result
    says why. Poisoned weights therefore never reach :meth:`state_dict_for_publish`.
    """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version: the number of applied steps (restored by a checkpoint)."""

    @abc.abstractmethod
    def step(self, rows: Sequence[Row]) -> StepResult:
        """Compute advantages and the loss on ``rows`` and apply one optimiser step."""

    @abc.abstractmethod
    def state_dict_for_publish(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the weights, Hugging Face names, for the weights channel."""

    @abc.abstractmethod
    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write weights, optimiser, version and RNG state to ``directory`` atomically."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore everything :meth:`save_checkpoint` wrote, for a bit-exact resume."""
