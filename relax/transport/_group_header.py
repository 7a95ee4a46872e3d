"""What a tensor group's ranks tell each other before any payload moves, and how failures
are named.

Every operation starts with an all-gather of one small int64 header per rank (protocol,
operation kind, source rank, sequence number, tensor count, byte count, a digest of dtypes and
shapes); :func:`check_headers` compares them, so ranks that disagree learn it before a single
payload byte moves. :func:`peer_gone` maps torch's backend and store errors to ``PeerGone``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relax.errors import PeerGone, TransportError

MAGIC = 0x524C5847  # "RLXG"
PROTOCOL = 1
ALIGN = 64  # bucket offsets; covers every dtype's alignment, so slices can be viewed as any dtype
# Payloads move in chunks, each with its own "no progress" limit (stall_timeout): gloo does
# not notice a peer that dies mid-transfer (it waits for the full operation timeout), and one
# chunk must not outlast the stall limit on a slow link (16 MiB in 5 s is 3.4 MB/s).
CHUNK = 16 << 20

# Header fields (one int64 each), all-gathered at the start of every operation.
KIND_OPEN, KIND_BARRIER, KIND_BROADCAST, KIND_BUCKET = 0, 1, 2, 3
KIND_NAMES = {0: "open", 1: "barrier", 2: "broadcast", 3: "broadcast_bucket"}
(_F_MAGIC, _F_PROTO, _F_KIND, _F_SRC, _F_SEQ, _F_WORLD, _F_OK, _F_COUNT, _F_BYTES, _F_DIGEST) = (
    range(10)
)


@dataclass(frozen=True)
class Layout:
    """Where each tensor sits in a bucket, plus a digest both sides compute identically."""

    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    total: int
    digest: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> Layout:
        h = hashlib.blake2b(digest_size=8)
        offsets, sizes, pos = [], [], 0
        for t in tensors:
            pos += (-pos) % ALIGN
            n = t.numel() * t.element_size()
            offsets.append(pos)
            sizes.append(n)
            pos += n
            h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        digest = int.from_bytes(h.digest(), "little", signed=True)
        return cls(tuple(offsets), tuple(sizes), pos, digest)


def header(
    kind: int, src: int, seq: int, world_size: int, ok: bool, count: int, layout: Layout
) -> list[int]:
    """This rank's header for operation ``seq``; ``ok`` is false when its arguments are bad."""
    step = [MAGIC, PROTOCOL, kind, src, seq, world_size, int(ok)]
    return [*step, count, sum(layout.nbytes), layout.digest]


def check_headers(
    headers: list[list[int]], rank: int, what: str
) -> tuple[str | None, TransportError | None]:
    """Compare every rank's header with this one's: ``(broken, error)``.

    ``broken`` says why the group can no longer be trusted (another protocol, ranks out of
    step), else ``None``; ``error`` is what this rank raises, else ``None`` (also when this
    rank rejected its own arguments: it raises its own ``ValueError``/``TypeError``).
    """
    mine = headers[rank]
    step = (_F_KIND, _F_SRC, _F_SEQ, _F_WORLD)
    for r, h in enumerate(headers):
        if h[_F_MAGIC] != MAGIC or h[_F_PROTO] != PROTOCOL:
            broken = f"rank {r} speaks another protocol (header {h})"
            return broken, TransportError(f"{what}: {broken}")
        if [h[i] for i in step] != [mine[i] for i in step]:
            # The ranks issued different operations: nothing later can be trusted.
            broken = (
                f"ranks out of step: rank {r} runs {_describe(h)}, "
                f"rank {rank} runs {_describe(mine)}"
            )
            return broken, TransportError(f"{what}: {broken}")
    rejected = [r for r, h in enumerate(headers) if not h[_F_OK]]
    if rejected:
        if rank in rejected:
            return None, None  # this rank raises its own ValueError/TypeError; no payload moves
        return None, TransportError(f"{what}: rank(s) {rejected} rejected their arguments")
    src = mine[_F_SRC]
    ref = headers[src]
    fields = (_F_COUNT, _F_BYTES, _F_DIGEST)
    wrong = [r for r, h in enumerate(headers) if [h[i] for i in fields] != [ref[i] for i in fields]]
    if wrong:
        details = "; ".join(
            f"rank {r} expects {headers[r][_F_COUNT]} tensors / {headers[r][_F_BYTES]} bytes"
            + (" of other dtypes or shapes" if headers[r][_F_BYTES] == ref[_F_BYTES] else "")
            for r in wrong
        )
        return None, TransportError(
            f"{what}: receive buffers do not match what rank {src} sends "
            f"({ref[_F_COUNT]} tensors / {ref[_F_BYTES]} bytes; dtypes and shapes must "
            f"match, in order): {details}"
        )
    return None, None


def validate(tensors: list[Any]) -> Exception | None:
    """The problem with this rank's arguments (not tensors, not dense), or ``None``."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            return TypeError(f"tensors[{i}] has layout {t.layout}; only dense tensors travel")
    return None


def _describe(h: list[int]) -> str:
    kind = KIND_NAMES.get(h[_F_KIND], f"kind {h[_F_KIND]}")
    return f"{kind} #{h[_F_SEQ]} from src {h[_F_SRC]} (world {h[_F_WORLD]})"


def peer_gone(what: str, exc: BaseException, late: str) -> PeerGone:
    """Map a torch/backend error into ``PeerGone``; ``late`` says what a timeout means here."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered:
        why = late
    elif "closed" in lowered or "reset" in lowered or "refused" in lowered:
        why = "a peer closed its connection (crashed or exited)"
    else:
        why = "the backend failed"
    return PeerGone(f"{what}: {why} ({type(exc).__name__}: {text})")
