"""Reading DeepSpeed's checkpoint files safely, and the names a state dict repeats.

DeepSpeed unpickles its checkpoints with ``weights_only=False``; :func:`load_weights_only`
reads them as tensors and plain containers instead, plus the few DeepSpeed classes its files
hold (:func:`safe_globals`).
"""

from __future__ import annotations

from typing import Any

import torch

DS_TAG = "deepspeed"
"""Sub-folder of a checkpoint that holds DeepSpeed's own files."""


def safe_globals() -> list[Any]:
    """The DeepSpeed classes its checkpoint files hold, allowed through ``weights_only``."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def load_weights_only(path: str, map_location: Any = None) -> Any:
    """``torch.load`` of a DeepSpeed checkpoint file without unpickling arbitrary objects."""
    with torch.serialization.safe_globals(safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True)


def aliases(state: dict[str, torch.Tensor]) -> set[str]:
    """Names whose tensor already appeared under an earlier name (tied weights). By identity,
    not storage: ZeRO-3 leaves every parameter an empty placeholder."""
    seen: set[int] = set()
    found = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            found.add(name)
        seen.add(id(tensor))
    return found
