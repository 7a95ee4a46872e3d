"""Pick the training backend ``[trainer] backend`` names; build a trainer's from its config."""

from __future__ import annotations

import random

import torch

from relax.config import AlgorithmConfig, ClusterConfig, LoraConfig, TrainerConfig
from relax.errors import ConfigError, ConfigIssue
from relax.models import (
    apply_lora,
    check_replayable,
    load_policy,
    lora_config,
    pad_token_id,
    resolve_device,
)
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
    lora: LoraConfig | None = None,
) -> TrainingBackend:
    """A :class:`TorchBackend` or a :class:`DeepSpeedBackend` training ``model``.

    ``rank``/``world_size`` place a DeepSpeed backend in its data-parallel world (a trainer
    gang); the torch backend trains on one rank only. DeepSpeed is imported only when chosen.
    ``lora`` (``[model.lora]``): inject adapters into ``model`` first, so that only they train
    (a model that already has them is trained as it is).
    """
    if trainer_cfg.routing_replay:
        check_replayable(model)  # a dense model, or routers R3 cannot drive: a clear error
    if lora is not None and lora_config(model) is None:
        model = apply_lora(model, lora)
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
    model = model.to(resolve_device(trainer_cfg.device))
    return TorchBackend(model, trainer_cfg, algorithm_cfg, pad_id=pad_id, temperature=temperature)


def build_backend(
    cfg: ClusterConfig, model_dir: str, *, rank: int = 0, world_size: int = 1
) -> TrainingBackend:
    """What a trainer (and a replay of one) starts from: the random state seeded by
    ``trainer.seed``, the policy in ``model_dir``, and the training backend around it."""
    torch.manual_seed(cfg.trainer.seed)
    random.seed(cfg.trainer.seed)
    model, tokenizer = load_policy(model_dir, cfg.trainer.dtype)
    return make_backend(
        cfg.trainer,
        cfg.algorithm,
        model,
        pad_token_id(tokenizer, model_dir),
        cfg.rollout.temperature,
        rank=rank,
        world_size=world_size,
        lora=cfg.model.lora,  # only the adapters train, publish and checkpoint
    )


def checkpoint_name(version: int) -> str:
    """The folder name of the checkpoint of ``version`` (they sort by version)."""
    return f"step-{version:08d}"
