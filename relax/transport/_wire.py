"""The one wire format: a msgpack header plus raw tensor buffers. Never pickle.

Layout of an encoded message (integers little endian)::

    b"RLX1" | u32 table length | u32 body length | table | body | padding | buffer area

``table`` (msgpack) lists ``[offset, nbytes]`` of each raw buffer inside the buffer area, which
starts 64-byte aligned so decoded tensors are aligned views; ``body`` (msgpack) is the payload. Inside the payload a tensor is a msgpack extension
``ExtType(1, msgpack([index, dtype, shape]))`` pointing at its buffer, so tensors travel as
raw bytes (safetensors-style dtype/shape/offset) and never pass through Python objects.

The payload may hold None, bool, int, float, str, bytes, lists/tuples (decoded as lists),
dicts with str/int keys, and torch tensors. Anything else is a ``TypeError`` at the sender;
a frame that is not ours or is damaged is a ``TransportError`` at the receiver.

torch is imported lazily: a process that never sends a tensor (a supervisor, a reward
worker) does not pay torch's import time.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Any

import msgpack

from relax.errors import TransportError

MAGIC = b"RLX1"
_PREFIX = struct.Struct("<4sII")
_ALIGN = 64
_EXT_TENSOR = 1

# Names are stable across torch versions and match safetensors' vocabulary where it has one.
_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
_DTYPE_NAMES = frozenset(_ITEMSIZE)


def _torch() -> Any:
    import torch

    return torch


def _is_tensor(obj: Any) -> bool:
    # Avoid importing torch just to answer "no": a tensor can only exist if torch is loaded.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _pad(n: int) -> int:
    return (-n) % _ALIGN


class RawTensor:
    """A tensor still in wire form: dtype, shape and a view of its bytes, no torch needed.

    A process that only stores and forwards tensors (the bus) decodes with
    ``loads(..., raw_tensors=True)``: no copy on the way in, none into a log record, one on the
    way out (``dumps`` sends it as the same tensor). ``to_torch()`` makes a real tensor.
    """

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, dtype: str, shape: list[int], data: memoryview) -> None:
        self.dtype, self.shape, self.data = dtype, list(shape), data

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RawTensor):
            return NotImplemented
        return (self.dtype, self.shape) == (other.dtype, other.shape) and self.data == other.data

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RawTensor(dtype={self.dtype}, shape={self.shape})"

    def to_torch(self) -> Any:
        """A real, writable, aligned torch tensor with these values (one copy)."""
        torch = _torch()
        out = torch.empty(self.shape, dtype=getattr(torch, self.dtype))
        if self.data.nbytes:
            memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")[:] = self.data
        return out


def dumps_parts(payload: Any) -> list[bytes | memoryview]:
    """Encode ``payload`` as the pieces of one message, tensor buffers not copied.

    For scatter writes (``os.writev``, a log append); ``dumps`` joins them.
    """
    buffers: list[memoryview] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, RawTensor):
            buffers.append(obj.data)
            return msgpack.ExtType(
                _EXT_TENSOR, msgpack.packb([len(buffers) - 1, obj.dtype, obj.shape])
            )
        if not _is_tensor(obj):
            raise TypeError(
                f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} over the wire; "
                "send None, bool, int, float, str, bytes, lists, dicts or torch tensors"
            )
        dtype = str(obj.dtype).removeprefix("torch.")
        if dtype not in _DTYPE_NAMES:
            raise TypeError(f"cannot send a tensor of dtype {obj.dtype}")
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(_torch().uint8).numpy() if flat.numel() else b""
        buffers.append(memoryview(raw).cast("B"))
        return msgpack.ExtType(
            _EXT_TENSOR, msgpack.packb([len(buffers) - 1, dtype, list(obj.shape)])
        )

    try:
        body = msgpack.packb(payload, default=default, use_bin_type=True)
    except (OverflowError, ValueError) as exc:
        raise TypeError(f"cannot encode payload: {exc}") from exc
    table, offset = [], 0
    for buf in buffers:
        offset += _pad(offset)
        table.append([offset, buf.nbytes])
        offset += buf.nbytes
    packed_table = msgpack.packb(table)
    head_len = _PREFIX.size + len(packed_table) + len(body)
    parts: list[bytes | memoryview] = [
        _PREFIX.pack(MAGIC, len(packed_table), len(body)),
        packed_table,
        body,
    ]
    written = -_pad(head_len)  # the padding after the header counts as area position < 0
    for (off, nbytes), buf in zip(table, buffers, strict=True):
        parts.append(b"\0" * (off - written))
        parts.append(buf)
        written = off + nbytes
    return parts


def dumps(payload: Any) -> bytes:
    """Encode ``payload`` (msgpack types and torch tensors) into one message."""
    return b"".join(dumps_parts(payload))


def loads(message: bytes | bytearray | memoryview, *, raw_tensors: bool = False) -> Any:
    """Decode one message made by :func:`dumps`.

    Tensors are views over one private, writable, 64-byte-aligned copy of the buffer area
    (the received bytes are immutable), so the caller may modify them in place. With
    ``raw_tensors`` they come back as ``RawTensor`` views of ``message`` itself: no copy, no
    torch; keep ``message`` alive as long as they are used.
    """
    view = memoryview(message).cast("B")
    if view.nbytes < _PREFIX.size:
        raise TransportError(f"frame too short ({view.nbytes} bytes) to be a Relax message")
    magic, table_len, body_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise TransportError(f"not a Relax message (magic {bytes(magic)!r}, expected {MAGIC!r})")
    body_start = _PREFIX.size + table_len
    head_end = body_start + body_len
    if head_end > view.nbytes:
        raise TransportError("truncated frame: header runs past the end of the message")
    try:
        table = msgpack.unpackb(view[_PREFIX.size : body_start])
    except Exception as exc:  # msgpack raises a zoo of types on corrupt input
        raise TransportError(f"corrupt frame: buffer table: {exc}") from exc
    area = view[head_end + _pad(head_end) :]
    if raw_tensors:
        buffers = _raw_buffers(area, table) if table else []
    else:
        buffers = _buffers(area, table) if table else []

    def ext_hook(code: int, data: bytes) -> Any:
        if code != _EXT_TENSOR:
            raise TransportError(f"unknown extension type {code} in frame")
        try:
            index, dtype, shape = msgpack.unpackb(data)
        except Exception as exc:
            raise TransportError(f"corrupt tensor description in frame: {exc}") from exc
        if raw_tensors:
            return _raw_tensor_from(buffers, index, dtype, shape)
        return _tensor_from(buffers, index, dtype, shape)

    try:
        return msgpack.unpackb(
            view[body_start:head_end], ext_hook=ext_hook, raw=False, strict_map_key=False
        )
    except TransportError:
        raise
    except Exception as exc:
        raise TransportError(f"corrupt frame body: {exc}") from exc


def _check_table(table: Any, area_bytes: int) -> list[tuple[int, int]]:
    if not isinstance(table, list):
        raise TransportError("corrupt frame: buffer table is not a list")
    entries = []
    for entry in table:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise TransportError("corrupt frame: bad buffer table entry")
        off, nbytes = entry
        if not (isinstance(off, int) and isinstance(nbytes, int)) or off < 0 or nbytes < 0:
            raise TransportError("corrupt frame: bad buffer table entry")
        if off + nbytes > area_bytes:
            raise TransportError("truncated frame: a buffer runs past the end of the message")
        entries.append((off, nbytes))
    return entries


def _raw_buffers(area_view: memoryview, table: Any) -> list[Any]:
    return [area_view[off : off + n] for off, n in _check_table(table, area_view.nbytes)]


def _raw_tensor_from(buffers: list[Any], index: Any, dtype: Any, shape: Any) -> RawTensor:
    _check_description(buffers, index, dtype, shape)
    itemsize = _ITEMSIZE[dtype]
    if math.prod(shape) * itemsize != buffers[index].nbytes:
        raise TransportError(
            f"tensor of shape {shape} and dtype {dtype} needs {math.prod(shape) * itemsize} "
            f"bytes, frame holds {buffers[index].nbytes}"
        )
    return RawTensor(dtype, shape, buffers[index])


def _check_description(buffers: list[Any], index: Any, dtype: Any, shape: Any) -> None:
    if dtype not in _DTYPE_NAMES:
        raise TransportError(f"unknown dtype {dtype!r} in frame")
    if not (isinstance(index, int) and 0 <= index < len(buffers)):
        raise TransportError(f"tensor refers to missing buffer {index!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise TransportError(f"bad tensor shape {shape!r} in frame")


def _buffers(area_view: memoryview, table: Any) -> list[Any]:
    """Copy the buffer area once into a 64-byte-aligned tensor and slice it per buffer."""
    entries = _check_table(table, area_view.nbytes)
    torch = _torch()
    area = torch.empty(area_view.nbytes, dtype=torch.uint8)  # torch's allocator aligns to 64
    if area_view.nbytes:
        memoryview(area.numpy()).cast("B")[:] = area_view
    return [area[off : off + n] for off, n in entries]


def _tensor_from(buffers: list[Any], index: Any, dtype: Any, shape: Any) -> Any:
    _check_description(buffers, index, dtype, shape)
    torch = _torch()
    torch_dtype = getattr(torch, dtype)
    raw = buffers[index]
    numel = math.prod(shape)
    if numel * _ITEMSIZE[dtype] != raw.numel():
        raise TransportError(
            f"tensor of shape {shape} and dtype {dtype} needs {numel * _ITEMSIZE[dtype]} bytes, "
            f"frame holds {raw.numel()}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return raw.view(torch_dtype).reshape(shape)
