"""The DeepSpeed ZeRO training backend, and the byte collectives a trainer gang talks over.

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
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax.config import AlgorithmConfig, TrainerConfig
from relax.runfiles import GANG_RENDEZVOUS_ENV
from relax.training import _checkpoint as ckpt
from relax.training._objective import check_supported
from relax.training._torch import _MAX_METRICS, SafeStepBackend

log = logging.getLogger("relax.training")

DS_TAG = "deepspeed"
"""Sub-folder of a checkpoint that holds DeepSpeed's own files."""
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)
"""How long a rank waits in a collective: ranks above 0 wait for rank 0's next command while
rank 0 waits for rollouts, which may take long. A dead rank ends the whole gang anyway."""
STORE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a gang's ranks wait for each other to meet (starting means importing torch)."""
_PRECISIONS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------- the world


def init_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Join (or reuse) the default torch.distributed group; returns ``(rank, world_size)``.

    An existing default group is reused as it is (a launcher or an earlier backend made it).
    Otherwise a world of more than one rank meets through the ``env://`` rendezvous
    (``MASTER_ADDR``/``MASTER_PORT``, as a gang's members have them), and a single rank makes
    its own one-member group on an in-process store (no port): no launcher and no environment
    variables needed. DeepSpeed insists on ``LOCAL_RANK``; it is set only when missing.
    """
    if dist.is_initialized():
        have = dist.get_world_size()
        if world_size is not None and world_size != have:
            raise RuntimeError(
                f"torch.distributed already has a world of {have} ranks, not {world_size}"
            )
        return dist.get_rank(), have
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    backend = "gloo" if not torch.cuda.is_available() else "nccl"
    rendezvous = os.environ.get(GANG_RENDEZVOUS_ENV)
    if world_size > 1 and rendezvous:
        # A Relax gang: rank 0's store listens on a port the kernel picked, announced in the
        # gang's rendezvous folder (a port picked free and bound again later is a race).
        dist.init_process_group(
            backend,
            store=_gang_store(Path(rendezvous), rank, world_size),
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    elif world_size > 1:  # a launcher's env:// rendezvous (torchrun, deepspeed)
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    else:
        # A world of one meets nobody: an in-process store, no port to pick (picking a free
        # port, closing it and binding it again races with every other process).
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=COLLECTIVE_TIMEOUT,
        )
    return rank, world_size


def _gang_store(folder: Path, rank: int, world_size: int) -> dist.TCPStore:
    """The store a gang's world meets on: rank 0 listens on port 0 and writes the port it got
    to ``folder/port`` (atomically); the other ranks wait for that file, then connect. Sets
    ``MASTER_PORT`` to the real port, for code that reads it later."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port_file = folder / "port"
    if rank == 0:
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
        )
        partial = folder / f"port.{os.getpid()}.partial"
        partial.write_text(str(store.port))
        partial.replace(port_file)
    else:
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while not port_file.exists():  # rank 0 is starting (importing torch, binding)
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 never announced its store in {folder}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    os.environ["MASTER_PORT"] = str(store.port)
    return store


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank ``src``'s ``data`` on every rank of the default group (a length, then the bytes)."""
    device = _device() if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = dist.get_rank() == src
    if mine and data is None:
        raise ValueError("the source rank must pass the bytes to broadcast")
    size = torch.tensor(
        [len(data) if mine and data is not None else 0], dtype=torch.int64, device=device
    )
    dist.broadcast(size, src)
    n = int(size.item())
    if n == 0:
        return b""
    if mine and data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src)
    return data if mine and data is not None else buffer.cpu().numpy().tobytes()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank of the default group."""
    device = _device() if dist.get_backend() == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [
        g[: int(s.item())].cpu().numpy().tobytes() for g, s in zip(gathered, sizes, strict=True)
    ]


# --------------------------------------------------------------------------- configuration


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


# --------------------------------------------------------------------------- the backend


def _no_cpu_kernels() -> None:
    """On CPU, tell DeepSpeed none of its C++ ops are available before it probes them.

    We need none (torch's AdamW, gloo all-reduces), but DeepSpeed's CPU comm backend would
    JIT-compile its shared-memory all-reduce kernel on first use — about a minute on 2 cores,
    serialised across processes by a file lock — and probing every op runs compilers too.
    DeepSpeed keeps this dict in ``deepspeed.ops`` precisely so callers can edit it.
    """
    import deepspeed.ops
    import torch

    if torch.cuda.is_available():
        return
    probed = vars(deepspeed.ops).get("__compatible_ops__")
    if probed is None:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    else:
        probed.update(dict.fromkeys(probed, False))


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
        check_supported(algorithm_config)
        try:
            import deepspeed
        except ImportError as exc:
            raise ImportError(
                'trainer.backend = "deepspeed" needs the deepspeed package (pip install deepspeed)'
            ) from exc

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        _no_cpu_kernels()
        self.rank, self.world_size = init_world(rank, world_size)
        self.trainer_config = trainer_config
        self.algorithm_config = algorithm_config
        self.pad_id = pad_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.mode = precision(trainer_config.dtype)
        self.stage = trainer_config.effective_zero_stage or 0
        model = model.to(_TORCH_DTYPES[self.mode])
        model.train()
        self.engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(trainer_config, self.world_size, self.mode),
        )
        self.model: torch.nn.Module = self.engine.module
        # DeepSpeed unpickles its checkpoints with weights_only=False; read them as tensors and
        # plain containers instead, plus the few DeepSpeed classes its files hold.
        self.engine.checkpoint_engine.load = _load_weights_only
        self._version = 0
        self.skipped_steps = 0

    @property
    def version(self) -> int:
        return self._version

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
                if key in _MAX_METRICS:
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

    def state_dict_for_publish(self, *, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """Full CPU weights under Hugging Face names on rank 0 (on every rank with
        ``every_rank``; other ranks get ``{}``). Collective under ZeRO-3, which gathers each
        partitioned weight in turn."""
        keep = self.is_main or every_rank
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            with self._gathered([tensor]):
                if keep:
                    out[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return out

    def adopt(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Continue from published weights ``version`` (collective; every rank passes them,
        only rank 0's count under ZeRO-3). The optimiser's moments start afresh."""
        own = self.model.state_dict(keep_vars=True)
        unexpected = sorted(set(state_dict) - set(own))
        missing = sorted(set(own) - set(state_dict) - _aliases(own))
        if unexpected or missing:  # checked before anything is copied: no half-loaded model
            raise ValueError(
                f"published weights do not fit the model: missing {missing}, unexpected {unexpected}"
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
        self.engine.save_checkpoint(str(folder), tag=DS_TAG, save_latest=False)
        torch.save(
            {"rng": ckpt.rng_state(), "python_random": ckpt.python_random_state()},
            folder / f"rng-rank{self.rank}.pt",
        )
        weights = self.state_dict_for_publish()
        if self.is_main:
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


def _safe_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _load_weights_only(path: str, map_location: Any = None) -> Any:
    """``torch.load`` of a DeepSpeed checkpoint file without unpickling arbitrary objects."""
    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True)


def _aliases(state: dict[str, torch.Tensor]) -> set[str]:
    """Names whose tensor already appeared under an earlier name (tied weights). By identity,
    not storage: ZeRO-3 leaves every parameter an empty placeholder."""
    seen: set[int] = set()
    aliases = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            aliases.add(name)
        seen.add(id(tensor))
    return aliases
