"""Pick the training backend ``[trainer] backend`` names."""

from __future__ import annotations

import torch

from relax.config import AlgorithmConfig, TrainerConfig
from relax.errors import ConfigError, ConfigIssue
from relax.training._base import TrainingBackend
from relax.training._torch import TorchBackend


def make_backend(
    trainer_cfg: TrainerConfig,
    algorithm_cfg: AlgorithmConfig,
    model: torch.nn.Module,
    pad_id: int,
    temperature: float,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> TrainingBackend:
    """A :class:`TorchBackend` or a :class:`DeepSpeedBackend` training ``model``.

    ``rank``/``world_size`` place a DeepSpeed backend in its data-parallel world (a trainer
    gang); the torch backend trains on one rank only. DeepSpeed is imported only when chosen.
    """
    if trainer_cfg.backend == "deepspeed":
        from relax.training._deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(
            model,
            trainer_cfg,
            algorithm_cfg,
            pad_id=pad_id,
            temperature=temperature,
            rank=rank,
            world_size=world_size,
        )
    if world_size is not None and world_size > 1:
        raise ConfigError(
            [
                ConfigIssue(
                    "trainer.gang",
                    f'a trainer gang of {world_size} ranks needs backend = "deepspeed",'
                    f" but backend is {trainer_cfg.backend!r}",
                    hint='set trainer.backend = "deepspeed" or trainer.gang = 1',
                )
            ]
        )
    return TorchBackend(model, trainer_cfg, algorithm_cfg, pad_id=pad_id, temperature=temperature)
