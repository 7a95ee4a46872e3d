"""Optimisation backends: turn scored sample rows into policy updates.

- :func:`pack_batch` packs bus rows into right-padded tensors (:class:`Batch`), per-token
  columns aligned to next-token prediction positions.
- :func:`sequence_logprobs` scores a batch's response tokens under a model.
- :class:`TrainingBackend` is the interface the trainer role drives; :class:`TorchBackend` is
  the plain-PyTorch implementation and :class:`DeepSpeedBackend` the DeepSpeed ZeRO one, on one
  rank or a data-parallel gang; both run :class:`SafeStepBackend`'s step (advantages, losses and
  off-policy corrections come from :mod:`relax.algos` as ``[algorithm]`` selects).
- :func:`make_backend` builds the one ``[trainer] backend`` names; :func:`build_backend` the
  whole starting point of a trainer (seeded random state, policy, backend) from its config.

``DeepSpeedBackend`` is loaded on first use: importing this package does not import DeepSpeed.
"""

from typing import Any

from relax.training._base import StepResult, TrainingBackend
from relax.training._batch import Batch, Row, pack_batch, response_values
from relax.training._factory import build_backend, checkpoint_name, make_backend
from relax.training._logprobs import forward_logprobs, sequence_logprobs
from relax.training._safe_step import SafeStepBackend
from relax.training._torch import TorchBackend
from relax.training._value import CriticTrainer, ValueModel, clipped_value_loss, value_forward

__all__ = [
    "Batch",
    "CriticTrainer",
    "DeepSpeedBackend",
    "Row",
    "SafeStepBackend",
    "StepResult",
    "TorchBackend",
    "TrainingBackend",
    "ValueModel",
    "build_backend",
    "checkpoint_name",
    "clipped_value_loss",
    "forward_logprobs",
    "make_backend",
    "pack_batch",
    "response_values",
    "sequence_logprobs",
    "value_forward",
]


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedBackend":
        from relax.training._deepspeed import DeepSpeedBackend

        return DeepSpeedBackend
    raise AttributeError(f"module 'relax.training' has no attribute {name!r}")
