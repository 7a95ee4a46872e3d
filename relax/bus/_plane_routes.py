"""Which way the weight plane moves a version to one group's receivers, and the CUDA IPC
hand-off for receivers on the trainer's own GPU.

Three routes, chosen by the publisher for each group it forms, from the GPU every receiver
reported when it polled (``gpu_of`` its engine's device, or none):

- ``"ipc"``: every receiver runs on the publisher's GPU (the one-GPU layout: trainer and
  rollout colocated). The publisher keeps one staging buffer of a bucket's size on its GPU;
  a gloo group on CPU carries its CUDA IPC handle with each bucket, every receiver maps it
  once (the mapping is kept for the group's life: opening a handle costs milliseconds) and
  copies each bucket out device to device, then a barrier lets the publisher refill it. So
  the publisher's extra GPU memory is one bucket. NCCL cannot do this: two ranks of one NCCL
  communicator on the same GPU are refused.
- ``"nccl"``: every receiver on a GPU of its own, none on the publisher's.
- ``"gloo"``: anything else (a receiver on CPU, a mix, a receiver in the publisher's own
  process, as with roles placed "inproc", where CUDA IPC cannot map): tensors staged through
  host memory.

The handle is a plain tuple of ints and bytes (``UntypedStorage._share_cuda_``), sent as
msgpack, never pickled.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import msgpack

HANDLE_BYTES = 1024  # one fixed-size broadcast carries a bucket's handle (msgpack is ~250 B)
_ALIGN = 256  # slot alignment in a shared bucket: any dtype's views line up


def this_process() -> str:
    """Which process this is, machine-wide (a receiver in the publisher's own process cannot
    map its CUDA memory)."""
    return f"{socket.gethostname()}/{os.getpid()}"


def gpu_of(device: Any) -> str | None:
    """The UUID of the GPU ``device`` is on (``None`` for a CPU or absent device)."""
    if device is None:
        return None
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def choose_route(
    own_gpu: str | None,
    members: Mapping[str, str | None],
    *,
    forced: str | None = None,
    nccl: bool = True,
    same_process: Collection[str] = (),
) -> str:
    """The route for a group of ``members`` (receiver -> its GPU) from a publisher whose
    weights are on ``own_gpu``; ``same_process``: the members in the publisher's process.
    ``forced`` (``[weights]``'s group device, tests) overrides: a CUDA device means NCCL, a
    CPU one gloo."""
    if forced is not None:
        return "nccl" if forced.startswith("cuda") else "gloo"
    gpus = list(members.values())
    if own_gpu is None or not gpus or any(gpu is None for gpu in gpus) or same_process:
        return "gloo"
    if all(gpu == own_gpu for gpu in gpus):
        return "ipc"
    if nccl and own_gpu not in gpus and len(set(gpus)) == len(gpus):
        return "nccl"
    return "gloo"


def slots(layout: Sequence[Sequence[Any]]) -> tuple[list[int], int]:
    """Byte offsets of a bucket's tensors (``[name, dtype, shape]`` rows) in a shared flat
    buffer, and its size."""
    import torch

    offsets, pos = [], 0
    for _, dtype, shape in layout:
        pos += (-pos) % _ALIGN
        offsets.append(pos)
        count = 1
        for n in shape:
            count *= int(n)
        pos += count * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return offsets, pos


def pack_bucket(
    flat: Any, tensors: Sequence[Any], layout: Sequence[Sequence[Any]], stream: Any = None
) -> None:
    """Copy ``tensors`` into the flat ``uint8`` buffer ``flat`` at ``slots(layout)``; on a
    GPU, on ``stream`` (a stream of its own: the publish's file copy keeps the default
    stream busy with device-to-host copies, which the packing must not queue behind), and
    waits for it. The tensors must be ready (the checksums before read them)."""
    import contextlib

    import torch

    offsets, total = slots(layout)
    if total > flat.numel():
        raise ValueError(f"a bucket of {total} bytes does not fit a buffer of {flat.numel()}")
    on = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with torch.no_grad(), on:
        for tensor, offset in zip(tensors, offsets, strict=True):
            n = tensor.numel() * tensor.element_size()
            view = flat[offset : offset + n].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor, non_blocking=True)
    if flat.device.type == "cuda":
        # The receivers read it from other processes: the bytes must be there first.
        (stream or torch.cuda.current_stream(flat.device)).synchronize()


def unpack_bucket(flat: Any, layout: Sequence[Sequence[Any]]) -> list[Any]:
    """Copies (on ``flat``'s device) of the tensors ``pack_bucket`` put in ``flat``."""
    import torch

    offsets, _ = slots(layout)
    out = []
    for (_, dtype, shape), offset in zip(layout, offsets, strict=True):
        dt = getattr(torch, dtype)
        n = 1
        for size in shape:
            n *= int(size)
        n *= torch.empty((), dtype=dt).element_size()
        out.append(flat[offset : offset + n].view(dt).view(list(shape)).clone())
    return out


def share(flat: Any) -> Any:
    """A CPU ``uint8`` tensor of ``HANDLE_BYTES`` carrying ``flat``'s CUDA IPC handle."""
    import torch

    fields = list(flat.untyped_storage()._share_cuda_())
    data = msgpack.packb([*fields, flat.storage_offset(), flat.numel()], use_bin_type=True)
    if len(data) + 4 > HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle of {len(data)} bytes does not fit {HANDLE_BYTES}")
    out = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    out[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    out[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def open_shared(handle: Any) -> Any:
    """The publisher's flat buffer, mapped into this process from ``share``'s tensor."""
    import torch

    raw = bytes(handle.numpy().tobytes())
    size = int.from_bytes(raw[:4], "little")
    if not 0 < size <= HANDLE_BYTES - 4:
        raise ValueError(f"not a CUDA IPC handle (length {size})")
    fields = msgpack.unpackb(raw[4 : 4 + size], raw=False)
    *storage_fields, offset, numel = fields
    device = int(storage_fields[0])
    storage = torch.UntypedStorage._new_shared_cuda(*storage_fields)
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    return flat.set_(storage, int(offset), (int(numel),), (1,))


__all__ = [
    "HANDLE_BYTES",
    "choose_route",
    "gpu_of",
    "open_shared",
    "pack_bucket",
    "share",
    "slots",
    "this_process",
    "unpack_bucket",
]
