"""Optimisation backends: turn scored sample rows into policy updates.

- :func:`pack_batch` packs bus rows into right-padded tensors (:class:`Batch`), per-token
  columns aligned to next-token prediction positions.
- :func:`sequence_logprobs` scores a batch's response tokens under a model.
- :class:`TrainingBackend` is the interface the trainer role drives; :class:`TorchBackend` is
  the plain-PyTorch implementation (advantages, losses and off-policy corrections come from
  :mod:`relax.algos` as ``[algorithm]`` selects).
"""

from relax.training._base import StepResult, TrainingBackend
from relax.training._batch import Batch, Row, pack_batch, response_values
from relax.training._logprobs import forward_logprobs, sequence_logprobs
from relax.training._torch import TorchBackend

__all__ = [
    "Batch",
    "Row",
    "StepResult",
    "TorchBackend",
    "TrainingBackend",
    "forward_logprobs",
    "pack_batch",
    "response_values",
    "sequence_logprobs",
]
