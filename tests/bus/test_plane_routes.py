"""How the weight plane picks a route per group (gloo, NCCL, CUDA IPC) from the GPUs the
receivers report, and the shared-bucket layout the IPC route packs into."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.bus import BusClient
from relax.bus._plane import PlaneOptions, WeightPublisher, WeightSubscriber
from relax.bus._plane_routes import (
    choose_route,
    gpu_of,
    pack_bucket,
    slots,
    this_process,
    unpack_bucket,
)
from tests.bus.fixtures import tcp_bus
from tests.polling import wait_until

FAST = PlaneOptions(bucket_bytes=1 << 20, timeout=20.0, stall_timeout=2.0, lease=2.0)


@pytest.mark.parametrize(
    ("own", "members", "route"),
    [
        (None, {"a": None}, "gloo"),  # a CPU trainer
        (None, {"a": "GPU-1"}, "gloo"),  # a CPU trainer, a GPU rollout: staged through host
        ("GPU-0", {"a": "GPU-0"}, "ipc"),  # one GPU for both: NCCL refuses two ranks on it
        ("GPU-0", {"a": "GPU-0", "b": "GPU-0"}, "ipc"),
        ("GPU-0", {"a": "GPU-1", "b": "GPU-2"}, "nccl"),  # a GPU each
        ("GPU-0", {"a": "GPU-1", "b": "GPU-1"}, "gloo"),  # two receivers share a GPU
        ("GPU-0", {"a": "GPU-0", "b": "GPU-1"}, "gloo"),  # a mix
        ("GPU-0", {"a": "GPU-1", "b": None}, "gloo"),  # one receiver on CPU
        ("GPU-0", {}, "gloo"),
    ],
)
def test_the_route_follows_where_the_weights_are(own, members, route) -> None:
    assert choose_route(own, members) == route


def test_a_receiver_in_the_publisher_s_process_is_never_handed_cuda_ipc() -> None:
    # Roles placed "inproc" share a process: CUDA IPC cannot map a process's own memory.
    assert choose_route("GPU-0", {"a": "GPU-0"}, same_process=["a"]) == "gloo"
    assert choose_route("GPU-0", {"a": "GPU-1"}, same_process=["a"]) == "gloo"


def test_a_forced_group_device_overrides_the_choice_and_nccl_needs_nccl() -> None:
    assert choose_route("GPU-0", {"a": "GPU-0"}, forced="cpu") == "gloo"
    assert choose_route(None, {"a": None}, forced="cuda:0") == "nccl"
    assert choose_route("GPU-0", {"a": "GPU-1"}, nccl=False) == "gloo"


def test_a_cpu_device_has_no_gpu() -> None:
    assert gpu_of(None) is None
    assert gpu_of("cpu") is None
    assert gpu_of(torch.device("cpu")) is None


def test_a_shared_bucket_holds_every_tensor_aligned_and_gives_back_copies() -> None:
    tensors = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int8),  # odd byte count: the next slot is realigned
        torch.randn(4).bfloat16(),
        torch.zeros(0),
        torch.randn(2, 2, dtype=torch.float64),
    ]
    layout = [
        [f"t{i}", str(t.dtype).removeprefix("torch."), list(t.shape)] for i, t in enumerate(tensors)
    ]
    offsets, total = slots(layout)
    assert all(o % 256 == 0 for o in offsets)
    assert total == offsets[-1] + 32
    flat = torch.empty(total, dtype=torch.uint8)
    pack_bucket(flat, tensors, layout)
    out = unpack_bucket(flat, layout)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(out, tensors, strict=True))
    flat.zero_()  # copies, not views of the publisher's buffer (refilled after the barrier)
    assert torch.equal(out[0], tensors[0])
    with pytest.raises(ValueError, match="does not fit"):
        pack_bucket(torch.empty(total - 1, dtype=torch.uint8), tensors, layout)


@pytest.mark.anyio
async def test_receivers_report_their_gpu_and_the_publisher_picks_the_group_s_route(
    tmp_path,
) -> None:
    """Receivers' GPUs reach the publisher through their polls; a mix of a GPU receiver and
    a CPU one gets the gloo route (both receive, on CPU), whatever GPU the trainer is on —
    before, a trainer with CUDA formed an NCCL group that CPU receivers joined with gloo."""
    async with (
        tcp_bus(str(tmp_path)) as url,
        await BusClient.connect(url) as trainer_bus,
        await BusClient.connect(url) as bus_a,
        await BusClient.connect(url) as bus_b,
    ):
        pub = WeightPublisher(trainer_bus, FAST)
        pub._gpu = "GPU-trainer"  # as if its weights were on that GPU
        a = WeightSubscriber(bus_a, "a", FAST)
        a._gpu = "GPU-trainer"
        b = WeightSubscriber(bus_b, "b", FAST)
        # auto: an engine on CPU reads the bus's file where it can, one on a GPU does not
        assert FAST.reads_local_file(None) and not FAST.reads_local_file("GPU-trainer")

        async def reported() -> bool:
            got = await trainer_bus._call({"op": "w_members", "lease": 5.0, "places": True})
            return {m: p["gpu"] for m, p in got.items()} == {"a": "GPU-trainer", "b": None}

        a._reads_file = b._reads_file = False  # keep both on the group for this test
        try:
            waits = [asyncio.create_task(s.next(-1, wait=60)) for s in (a, b)]
            await wait_until(reported, what="both polling with their GPUs")
            state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
            assert await pub.publish(1, state) == 2
            assert pub.statistics()["route"] == "gloo"
            for got in await asyncio.gather(*waits):
                assert got is not None and got[0] == 1
                assert all(torch.equal(got[1][k], state[k]) for k in state)
                assert all(t.device.type == "cpu" for t in got[1].values())
            # A receiver leaving forgets its GPU too.
            await b.leave()
            got = await trainer_bus._call({"op": "w_members", "lease": 5.0, "places": True})
            assert got == {"a": {"gpu": "GPU-trainer", "proc": this_process()}}
        finally:
            await a.aclose()
            await pub.aclose()
