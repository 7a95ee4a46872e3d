"""The DeepSpeed ZeRO training backend.

:class:`DeepSpeedBackend` runs the same all-or-nothing step as :class:`TorchBackend` (the
shared :class:`SafeStepBackend`) inside a ``deepspeed.initialize`` engine: ZeRO stage 0 to 3,
torch's AdamW (``"torch_adam": true``: no CPUAdam build), gradient clipping, bf16 where the
accelerator has it (fp16 too, on accelerators that support it), fp32 otherwise.

Data parallelism. Every rank receives the *whole* batch (advantages need every row of a group),
then runs its share of the micro-batches: round ``k`` gives micro-batch ``k * N + rank`` to each
of the ``N`` ranks. A rank that has none left in a round runs a stand-in micro-batch weighted 0,
so every rank calls ``backward`` equally often (ZeRO reduces gradients inside ``backward``).
DeepSpeed averages gradients over ranks, so each micro-batch loss is weighted by its share of
the batch's loss denominator times ``N``: the reduced gradient is the whole-batch gradient.
A rank that meets a non-finite loss keeps going (the others are waiting in the collectives);
the ranks then exchange their metrics and problems and all skip together.

The skip check under ZeRO. After the last micro-batch (the accumulation boundary) the reduced
gradient sits in the ZeRO optimiser's partitions. Before ``engine.step()`` this backend asks the
optimiser for the global norm with the very function its ``step`` would call
(``scaled_global_norm`` for stages 1/2, the stage-3 per-group norms combined, or the
unpartitioned gradients for stage 0): each rank's partial sum of squares is all-reduced, so all
ranks get the same norm and take the same decision. A step to skip never reaches
``engine.step()``; its gradients are dropped the way DeepSpeed's own overflow path drops them,
so weights, fp32 master weights and AdamW moments stay bit-identical.

Checkpoints (collective on every rank): Hugging Face ``model.safetensors`` + ``config.json``
(``from_pretrained`` loads them), DeepSpeed's own checkpoint under ``deepspeed/`` (module,
fp32 master partitions and optimiser state of every rank), per-rank RNG state and the JSON
metadata; written to a temp dir that rank 0 renames into place.

LoRA: a model with adapters (``relax.models.apply_lora``) hands DeepSpeed only the adapter
parameters; the frozen base is left out of its optimiser, of its checkpoint
(``exclude_frozen_parameters``) and of every publish, which holds the adapter tensors alone;
the Hugging Face part of a checkpoint is the adapter in peft's layout.

The engine's config comes from ``_deepspeed_config``, safe reading of DeepSpeed's checkpoint
files from ``_deepspeed_checkpoint``; the world the ranks share and the bytes they exchange over
it from :mod:`relax.transport`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax.config import AlgorithmConfig, TrainerConfig
from relax.models import adapter_parameters, adapter_problems, lora_config
from relax.training import _checkpoint as ckpt
from relax.training._deepspeed_checkpoint import DS_TAG, aliases, load_weights_only
from relax.training._deepspeed_config import (
    TORCH_DTYPES,
    deepspeed_config,
    forget_groups_of_a_gone_world,
    no_cpu_kernels,
    precision,
)
from relax.training._safe_step import MAX_METRICS, SafeStepBackend
from relax.transport import all_gather_bytes, broadcast_bytes, init_world

log = logging.getLogger("relax.training")


class DeepSpeedBackend(SafeStepBackend):
    """Trains a Hugging Face causal LM with a DeepSpeed ZeRO engine, on one rank or many.

    Every method is collective: in a world of N ranks, every rank calls the same methods in
    the same order (``step`` with the same rows). World size 1 needs no launcher.
    """

    runs_every_micro_batch = True

    def __init__(
        self,
        model: torch.nn.Module,
        trainer_config: TrainerConfig,
        algorithm_config: AlgorithmConfig,
        *,
        pad_id: int = 0,
        temperature: float = 1.0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """``rank``/``world_size`` default to the existing group, else ``RANK``/``WORLD_SIZE``
        from the environment, else a single rank; ``temperature`` as for ``TorchBackend``."""
        super().__init__(trainer_config, algorithm_config, pad_id=pad_id, temperature=temperature)
        try:
            import deepspeed
        except ImportError as exc:
            raise ImportError(
                'trainer.backend = "deepspeed" needs the deepspeed package (pip install deepspeed)'
            ) from exc

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        no_cpu_kernels()
        self.rank, self.world_size = init_world(rank, world_size)
        forget_groups_of_a_gone_world()
        self.mode = precision(trainer_config.dtype)
        self.stage = trainer_config.effective_zero_stage or 0
        model = model.to(TORCH_DTYPES[self.mode])
        model.train()
        self.lora = lora_config(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if self.lora is not None:
            ckpt.check_only_adapters_train(model, trainable)
        self.engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=trainable,
            config=deepspeed_config(trainer_config, self.world_size, self.mode),
        )
        self.model: torch.nn.Module = self.engine.module
        # DeepSpeed unpickles its checkpoints with weights_only=False; read them as tensors and
        # plain containers instead, plus the few DeepSpeed classes its files hold.
        self.engine.checkpoint_engine.load = load_weights_only

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ step hooks

    def _forward_module(self) -> torch.nn.Module:
        return self.engine

    def _micro_batch_schedule(self, count: int) -> list[int | None]:
        rounds = -(-count // self.world_size)
        return [
            index if index < count else None
            for index in (r * self.world_size + self.rank for r in range(rounds))
        ]

    def _loss_scale(self) -> float:
        return float(self.world_size)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        # The micro-batch weights already sum to 1 over the batch: no 1/accumulation factor.
        self.engine.backward(loss, scale_wrt_gas=False)

    def _combine(
        self, sums: dict[str, float], problem: str | None
    ) -> tuple[dict[str, float], str | None]:
        if self.world_size == 1:
            return sums, problem
        merged: dict[str, float] = {}
        problems = []
        # JSON keeps NaN and infinities (Python's dialect), which a poisoned step reports.
        for data in all_gather_bytes(json.dumps({"sums": sums, "problem": problem}).encode()):
            part = json.loads(data)
            if part["problem"] is not None:
                problems.append(part["problem"])
            for key, value in part["sums"].items():
                if key in MAX_METRICS:
                    merged[key] = max(merged.get(key, -math.inf), value)
                else:
                    merged[key] = merged.get(key, 0.0) + value
        return merged, problems[0] if problems else None

    def _global_grad_norm(self) -> float:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.utils import combine_grad_norm_groups, get_global_norm_of_tensors

        opt = self.engine.optimizer
        if self.stage in (1, 2):
            norm = opt.scaled_global_norm() / opt.loss_scale
        elif self.stage == 3:
            norm = combine_grad_norm_groups(opt._get_norm_groups()) / opt.loss_scale
        elif isinstance(opt, BF16_Optimizer):
            grads, _ = opt.get_grads_for_norm()
            norm = get_global_norm_of_tensors(grads, mpu=opt.mpu, norm_type=opt.norm_type)
        else:  # stage 0: the engine all-reduced whole gradients into .grad at the boundary
            grads = [p.grad.float() for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) / _loss_scale(opt)
        value = float(norm)
        # DeepSpeed's norm helpers turn inf/NaN into the sentinel -1.
        return math.inf if value < 0 else value

    def _apply_update(self, grad_norm: float) -> None:
        self.engine.step()  # clips with the same norm, steps AdamW, clears the gradients

    def _finish_step(self, applied: bool) -> None:
        if not applied:
            self._drop_gradients()

    def _drop_gradients(self) -> None:
        """Forget the accumulated gradient without touching weights or optimiser state:
        what each optimiser's own overflow branch does instead of stepping."""
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        opt = self.engine.optimizer
        if self.stage in (1, 2):
            from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

            opt.zero_grad(set_to_none=True)
            opt._release_preflattened_grad_buffers()
            for key in list(opt.averaged_gradients):
                opt.averaged_gradients[key] = None
            for key in list(opt.all_grad_tensors):
                opt.all_grad_tensors[key] = None
            opt.micro_step_id = INITIAL_MICRO_STEP_ID
        elif self.stage == 3:
            opt._pre_step()
            opt._partition_all_parameters()
            opt._overflow_clean_up(opt.loss_scale)
        elif isinstance(opt, BF16_Optimizer):
            opt.clear_hp_grads()
            opt.clear_lp_grads(set_to_none=True)
        else:
            self.engine.zero_grad()

    def _lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def _extra_metrics(self) -> dict[str, float]:
        return {"world_size": float(self.world_size)}

    # ------------------------------------------------------------------ weights

    def _gathered(self, tensors: list[torch.Tensor], modifier_rank: int | None = None) -> Any:
        """A context in which ZeRO-3 partitioned ``tensors`` are whole (a no-op below 3)."""
        import contextlib

        import deepspeed

        params = [t for t in tensors if hasattr(t, "ds_id")]
        if self.stage != 3 or not params:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)

    def _publishable(self) -> dict[str, torch.Tensor]:
        """What a publish holds: every weight, or the adapters of a LoRA model."""
        if self.lora is not None:
            return dict(adapter_parameters(self.model))
        return self.model.state_dict(keep_vars=True)

    def state_dict_for_publish(self, *, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """Full CPU weights under Hugging Face names (with LoRA: the adapter tensors, adapter
        names) on rank 0 (on every rank with ``every_rank``; other ranks get ``{}``).
        Collective under ZeRO-3, which gathers each partitioned weight in turn."""
        keep = self.is_main or every_rank
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self._publishable().items():
            with self._gathered([tensor]):
                if keep:
                    out[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return out

    def adopt(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Continue from published weights ``version`` (collective; every rank passes them,
        only rank 0's count under ZeRO-3). The optimiser's moments start afresh."""
        own = self._publishable()
        if self.lora is not None:
            problems = adapter_problems(self.model, state_dict.items())
            if problems:  # checked before anything is copied: no half-loaded adapter
                raise ValueError("published adapter does not fit the model: " + "; ".join(problems))
        else:
            unexpected = sorted(set(state_dict) - set(own))
            missing = sorted(set(own) - set(state_dict) - aliases(own))
            if unexpected or missing:  # checked before anything is copied: no half-loaded model
                raise ValueError(
                    f"published weights do not fit the model: missing {missing},"
                    f" unexpected {unexpected}"
                )
        with torch.no_grad():
            for name, tensor in own.items():
                if name not in state_dict:
                    continue
                with self._gathered([tensor], modifier_rank=0):
                    tensor.data.copy_(state_dict[name])
        opt = self.engine.optimizer
        refresh = getattr(opt, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()  # the fp32 master weights follow the module's
        base = getattr(opt, "optimizer", opt)
        with torch.no_grad():
            for state in base.state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        value.zero_()  # what a fresh AdamW starts from (step 0, zero moments)
        self._version = version

    # ------------------------------------------------------------------ checkpoints

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save to ``directory`` (collective: every rank calls it with the same path).

        Rank 0 makes the temp dir and tells the others; all write their parts, then rank 0
        renames it into place; every rank returns after the rename.
        """
        if self.is_main:
            path = ckpt.write_atomically(directory, self._write_checkpoint)
        else:
            self._write_checkpoint(None)
            path = Path(directory).resolve()
        self._barrier()
        return path

    def _write_checkpoint(self, tmp: Path | None) -> None:
        folder = Path(broadcast_bytes(str(tmp).encode() if tmp is not None else None).decode())
        self.engine.save_checkpoint(
            str(folder),
            tag=DS_TAG,
            save_latest=False,
            exclude_frozen_parameters=self.lora is not None,  # the base is the model folder's
        )
        torch.save(
            {"rng": ckpt.rng_state(), "python_random": ckpt.python_random_state()},
            folder / f"rng-rank{self.rank}.pt",
        )
        weights = self.state_dict_for_publish()
        if self.is_main:
            if self.lora is not None:
                ckpt.save_lora(folder, self.model, self.lora, weights)
            else:
                save = getattr(self.model, "save_pretrained", None)
                if save is None:
                    raise TypeError("DeepSpeedBackend checkpoints need a Hugging Face model")
                save(str(folder), state_dict=weights)
            ckpt.write_meta(
                folder,
                {
                    "backend": "deepspeed",
                    "zero_stage": self.stage,
                    "world_size": self.world_size,
                    "precision": self.mode,
                    "version": self._version,
                    "skipped_steps": self.skipped_steps,
                    "python_random": ckpt.python_random_state(),
                    **ckpt.lora_meta(self.lora),
                },
            )
        self._barrier()  # every rank's part is written before rank 0 renames the folder

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (collective).

        A checkpoint of the same ZeRO stage and world size resumes exactly (DeepSpeed's fp32
        master weights and optimiser partitions). Any other (another stage or world size, or a
        ``TorchBackend`` checkpoint) restores the Hugging Face weights and version, with the
        optimiser's moments starting afresh.
        """
        path = Path(directory)
        meta = ckpt.read_meta(path)
        ckpt.check_lora_matches(meta, self.lora, path)
        same = (
            meta.get("backend") == "deepspeed"
            and meta.get("zero_stage") == self.stage
            and meta.get("world_size") == self.world_size
            and meta.get("precision") == self.mode
        )
        if same:
            loaded, _ = self.engine.load_checkpoint(
                str(path),
                tag=DS_TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
                # A LoRA checkpoint left the frozen base out: it stays the model folder's.
                load_module_strict=self.lora is None,
            )
            if loaded is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint under {path / DS_TAG}")
            rng_file = path / f"rng-rank{self.rank}.pt"
            if rng_file.is_file():
                state = torch.load(rng_file, map_location="cpu", weights_only=True)
                ckpt.set_rng_state(state["rng"])
                ckpt.set_python_random_state(state["python_random"])
        else:
            from safetensors.torch import load_file

            if self.is_main:
                log.warning(
                    "checkpoint %s was written by backend %s (ZeRO stage %s, %s ranks);"
                    " restoring its weights, the optimiser state starts afresh",
                    path,
                    meta.get("backend"),
                    meta.get("zero_stage"),
                    meta.get("world_size", 1),
                )
            weights: dict[str, torch.Tensor] = {}
            if self.lora is not None:
                weights = ckpt.read_lora(path)
            else:
                for file in sorted(path.glob("*.safetensors")):
                    weights.update(load_file(str(file)))
            self.adopt(int(meta["version"]), weights)
            if self.rank == 0:
                ckpt.set_python_random_state(meta["python_random"])
        self._version = int(meta["version"])
        self.skipped_steps = int(meta.get("skipped_steps", 0))


def _loss_scale(optimizer: Any) -> float:
    """The static or dynamic loss scale of a stage-0 fp16 optimiser (1 for fp32 and bf16)."""
    scale = getattr(optimizer, "cur_scale", None)
    if scale is None:
        config = getattr(optimizer, "loss_scale_config", None)
        scale = getattr(config, "cur_scale", 1.0)
    return float(scale or 1.0)
