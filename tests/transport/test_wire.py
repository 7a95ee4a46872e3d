"""The wire format: msgpack header + raw tensor buffers; corrupt input is a TransportError."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.errors import TransportError
from relax.transport import dumps, loads
from relax.transport._wire import MAGIC

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_round_trip_exactly(dtype) -> None:
    t = (torch.randn(5, 7) * 10).to(dtype)
    out = loads(dumps({"t": t, "view": t[1:, ::2]}))
    assert out["t"].dtype == dtype and torch.equal(out["t"], t)
    assert torch.equal(out["view"], t[1:, ::2])  # non-contiguous input is sent as its values


def test_decoded_tensors_are_aligned_writable_and_independent_of_the_message() -> None:
    msg = dumps([torch.ones(3), torch.arange(10)])
    a, b = loads(msg)
    a += 1  # writable without a warning
    assert torch.equal(loads(msg)[0], torch.ones(3))
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0


def test_scalars_empties_and_nesting() -> None:
    payload = {
        "s": torch.tensor(3.5),
        "e": torch.zeros(0, 4),
        "n": [{"x": torch.tensor([1, 2])}],
        1: "int key",
    }
    out = loads(dumps(payload))
    assert out["s"].shape == () and out["s"].item() == 3.5
    assert out["e"].shape == (0, 4)
    assert torch.equal(out["n"][0]["x"], torch.tensor([1, 2]))
    assert out[1] == "int key"


def test_unsupported_types_fail_at_the_sender() -> None:
    with pytest.raises(TypeError, match="cannot send"):
        dumps({"f": lambda: 1})
    with pytest.raises(TypeError, match="cannot send"):
        dumps({1, 2})


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"RLX",
        b"XXXX" + b"\0" * 16,
        MAGIC + struct.pack("<II", 1000, 1000),
        MAGIC + struct.pack("<II", 1, 1) + b"\xc1\xc1",  # 0xc1 is never valid msgpack
    ],
)
def test_corrupt_frames_raise_transport_error(frame: bytes) -> None:
    with pytest.raises(TransportError):
        loads(frame)


def test_tensor_pointing_past_the_buffer_area_is_refused() -> None:
    good = dumps({"t": torch.arange(100)})
    with pytest.raises(TransportError):
        loads(good[:-80])  # truncated: the buffer runs past the end


def test_forged_tensor_descriptions_are_refused() -> None:
    table = msgpack.packb([[0, 8]])
    for meta in (
        [0, "float128", [1]],
        [5, "float32", [2]],
        [0, "float32", [3]],
        [0, "float32", "x"],
    ):
        body = msgpack.packb({"t": msgpack.ExtType(1, msgpack.packb(meta))})
        head = MAGIC + struct.pack("<II", len(table), len(body)) + table + body
        frame = head + b"\0" * ((-len(head)) % 64) + b"\0" * 8
        with pytest.raises(TransportError):
            loads(frame)
    body = msgpack.packb(msgpack.ExtType(9, b"??"))
    with pytest.raises(TransportError, match="unknown extension"):
        loads(MAGIC + struct.pack("<II", 1, len(body)) + msgpack.packb([]) + body)


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_like)
def test_any_msgpack_value_round_trips(value) -> None:
    assert loads(dumps(value)) == value


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        loads(MAGIC + data)
    except TransportError:
        pass


def test_raw_tensors_are_views_that_forward_without_torch_and_round_trip() -> None:
    from relax.transport import RawTensor

    t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    msg = dumps({"t": t, "b": torch.tensor(True)})
    raw = loads(msg, raw_tensors=True)
    assert isinstance(raw["t"], RawTensor) and raw["t"].shape == [3, 4] and len(raw["t"]) == 3
    assert raw["t"].data.obj is not None and raw["t"].nbytes == 24  # a view, not a copy
    assert torch.equal(raw["t"].to_torch(), t) and raw["b"].to_torch().item() is True
    forwarded = loads(dumps({"again": raw["t"]}))  # sent on as the same tensor
    assert torch.equal(forwarded["again"], t)
    assert raw["t"] == loads(msg, raw_tensors=True)["t"]
    with pytest.raises(TransportError):
        loads(msg[:-8], raw_tensors=True)
