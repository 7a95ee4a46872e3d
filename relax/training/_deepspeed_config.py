"""What ``deepspeed.initialize`` is given: the precision a ``[trainer]`` table can train in
here, the engine's config dict, and DeepSpeed's C++ op probing switched off on CPU."""

from __future__ import annotations

import logging
from typing import Any

import torch

from relax.config import TrainerConfig

log = logging.getLogger("relax.training")

_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The torch dtype the model is cast to for each DeepSpeed precision mode."""


def precision(dtype: str) -> str:
    """``"fp32"``, ``"bf16"`` or ``"fp16"``: the requested dtype, or fp32 where the
    accelerator cannot train in it (fp16 on most CPUs)."""
    from deepspeed.accelerator import get_accelerator

    wanted = _PRECISIONS[dtype]
    accelerator = get_accelerator()
    supported = {
        "fp32": True,
        "bf16": bool(accelerator.is_bf16_supported()),
        "fp16": bool(accelerator.is_fp16_supported()),
    }[wanted]
    if not supported:
        log.warning(
            "DeepSpeed on %s cannot train in %s; training in float32 instead",
            accelerator.device_name(),
            dtype,
        )
        return "fp32"
    return wanted


def deepspeed_config(cfg: TrainerConfig, world_size: int, mode: str) -> dict[str, Any]:
    """The ``deepspeed.initialize`` config of a ``[trainer]`` table on ``world_size`` ranks."""
    micro = cfg.micro_batch_size
    accumulation = max(1, cfg.global_batch_size // (micro * world_size))
    stage = cfg.effective_zero_stage
    config: dict[str, Any] = {
        # Bookkeeping only: the backend marks the accumulation boundary itself, so a batch
        # shortened by dynamic sampling still makes one step.
        "train_batch_size": micro * accumulation * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": list(cfg.betas),
                "eps": 1e-8,
                "weight_decay": cfg.weight_decay,
                "torch_adam": True,
                "fused": True,  # passed to torch's AdamW, as TorchBackend's
            },
        },
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": 2 if stage is None else stage},
        "bf16": {"enabled": mode == "bf16"},
        "fp16": {"enabled": mode == "fp16"},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    return config


def no_cpu_kernels() -> None:
    """On CPU, tell DeepSpeed none of its C++ ops are available before it probes them.

    We need none (torch's AdamW, gloo all-reduces), but DeepSpeed's CPU comm backend would
    JIT-compile its shared-memory all-reduce kernel on first use — about a minute on 2 cores,
    serialised across processes by a file lock — and probing every op runs compilers too.
    DeepSpeed keeps this dict in ``deepspeed.ops`` precisely so callers can edit it.
    """
    import deepspeed.ops

    if torch.cuda.is_available():
        return
    probed = vars(deepspeed.ops).get("__compatible_ops__")
    if probed is None:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    else:
        probed.update(dict.fromkeys(probed, False))


def forget_groups_of_a_gone_world() -> None:
    """Make DeepSpeed forget the process groups it cached from a world that was torn down.

    DeepSpeed clones the default group once per process and keeps the clone in module globals;
    it drops them only when the world is destroyed through ``deepspeed.comm``. Code that
    destroys it through torch instead (vLLM's cleanup does, in a process that also trains)
    leaves a stale clone behind, and the next engine fails in its first broadcast with "Group
    ... is not registered". A clone that torch no longer knows means every cached group is dead.
    """
    import torch.distributed as dist
    from deepspeed.utils import groups

    cached = getattr(groups, "_WORLD_GROUP", None)
    if cached is None:
        return
    if dist.is_initialized() and cached in dist.distributed_c10d._world.pg_group_ranks:
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)  # None: the whole world went, as deepspeed.comm's own teardown says
    else:  # an older DeepSpeed without it: the world's clone is the data-parallel group
        groups._WORLD_GROUP = None
