"""The crash-safe segment log: framing, rotation, torn tails, corruption, release, SIGKILL."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import relax.bus._log as log_module
from relax.bus._log import HEADER_SIZE, LogCorrupt, SegmentLog
from relax.errors import BusError


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def replayed(directory: Path, **kwargs: Any) -> list[tuple[int, bytes]]:
    with SegmentLog(directory, **kwargs) as log:
        return list(log.replay())


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- basics


def test_round_trip(tmp_path: Path) -> None:
    records = [b"", b"x", b"hello" * 100, bytes(range(256)) * 300]
    with SegmentLog(tmp_path) as log:
        seqs = [log.append(r) for r in records]
        # Any flat buffer is accepted without copying; numbers are unchanged by the type.
        seqs.append(log.append(bytearray(b"ba")))
        seqs.append(log.append(memoryview(b"mv")))
        seqs.append(log.append(memoryview(bytes(16)).cast("I")))
        assert seqs == list(range(7))
        assert log.append_many([b"a", b"b", b"c"]) == 9
        assert log.append_many([]) == 9
        assert list(log.replay()) == [
            *enumerate([*records, b"ba", b"mv", bytes(16)]),
            (7, b"a"),
            (8, b"b"),
            (9, b"c"),
        ]
        stats = log.statistics()
        assert stats["records"] == stats["appended"] == 10
        assert stats["segments"] == 1
        assert stats["bytes"] == sum(HEADER_SIZE + len(p) for _, p in log.replay())
    assert replayed(tmp_path)[-1] == (9, b"c")


def test_fresh_directory_is_created_and_starts_at_zero(tmp_path: Path) -> None:
    with SegmentLog(tmp_path / "a" / "b") as log:
        assert log.next_seq == 0 and log.first_seq == 0
        assert list(log.replay()) == []
        assert log.append(b"first") == 0
    assert [p.name for p in segments(tmp_path / "a" / "b")] == [f"{0:020d}.seg"]


def test_rotation_and_seq_continuity_across_reopen(tmp_path: Path) -> None:
    payload = b"p" * 30  # a 50-byte frame: two per 100-byte segment
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        assert [log.append(payload) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert [p.name for p in segments(tmp_path)] == [f"{n:020d}.seg" for n in (0, 2, 4)]
    assert [p.stat().st_size for p in segments(tmp_path)] == [100, 100, 50]
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        assert log.next_seq == 5
        assert log.append_many([payload] * 4) == 8  # a batch that spans two rotations
        assert log.statistics()["segments"] == 5
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        assert [s for s, _ in log.replay()] == list(range(9))
        assert log.append(b"z") == 9


def test_oversized_record_gets_a_segment_of_its_own(tmp_path: Path) -> None:
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        log.append(b"a")
        log.append(b"B" * 500)
        log.append(b"c")
    assert [p.stat().st_size for p in segments(tmp_path)] == [21, 520, 21]
    assert [p for _, p in replayed(tmp_path)] == [b"a", b"B" * 500, b"c"]


def test_directory_is_owned_by_one_log(tmp_path: Path) -> None:
    log = SegmentLog(tmp_path)
    with pytest.raises(BusError, match="in use"):
        SegmentLog(tmp_path)
    log.close()
    log.close()  # idempotent
    with pytest.raises(BusError, match="closed"):
        log.append(b"late")
    with SegmentLog(tmp_path) as again:
        assert again.append(b"ok") == 0


def test_fsync_policies(tmp_path: Path) -> None:
    with SegmentLog(tmp_path / "always", fsync="always") as log:
        base = log.statistics()["fsyncs"]
        log.append(b"a")
        log.append_many([b"b", b"c"])
        assert log.statistics()["fsyncs"] == base + 2
    with SegmentLog(tmp_path / "checkpoint") as log:
        base = log.statistics()["fsyncs"]
        log.append_many([b"a"] * 10)
        assert log.statistics()["fsyncs"] == base
        log.sync()
        log.sync()  # nothing new: no second fsync
        assert log.statistics()["fsyncs"] == base + 1
    with SegmentLog(tmp_path / "never", fsync="never", segment_bytes=64) as log:
        log.append_many([b"x" * 30] * 10)
        log.sync()
        log.release_before(5)
        assert log.statistics()["fsyncs"] == 0


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync"):
        SegmentLog(tmp_path, fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="segment_bytes"):
        SegmentLog(tmp_path, segment_bytes=4)


def test_replay_covers_records_present_when_it_starts(tmp_path: Path) -> None:
    with SegmentLog(tmp_path, segment_bytes=64) as log:
        log.append_many([b"r" * 20] * 3)
        it = log.replay()
        assert next(it) == (0, b"r" * 20)
        log.append_many([b"late"] * 3)
        assert [s for s, _ in it] == [1, 2]
        assert [s for s, _ in log.replay()] == list(range(6))


def test_failed_write_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with SegmentLog(tmp_path) as log:
        log.append(b"good")
        real_pwritev = os.pwritev

        def half_then_enospc(fd: int, buffers: list[Any], offset: int) -> int:
            # A short write of half the frame, then the disk is full.
            first = bytes(buffers[0])
            real_pwritev(fd, [first[: len(first) // 2]], offset)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(log_module.os, "pwritev", half_then_enospc)
        with pytest.raises(OSError, match="No space"):
            log.append(b"doomed" * 10)
        monkeypatch.undo()
        assert log.next_seq == 1
        assert segments(tmp_path)[0].stat().st_size == HEADER_SIZE + 4
        assert log.append(b"after") == 1
    assert replayed(tmp_path) == [(0, b"good"), (1, b"after")]


def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwritev = os.pwritev

    def at_most_7_bytes(fd: int, buffers: list[Any], offset: int) -> int:
        return real_pwritev(fd, [bytes(buffers[0])[:7]], offset)

    records = [b"", b"abc", b"x" * 100_000, b"tail"]
    with SegmentLog(tmp_path) as log:
        monkeypatch.setattr(log_module.os, "pwritev", at_most_7_bytes)
        log.append_many(records)
        monkeypatch.undo()
    assert [p for _, p in replayed(tmp_path)] == records


def test_append_speed(tmp_path: Path) -> None:
    """10,000 appends of 1 KB stay well under a second (measured: a few tens of ms)."""
    record = os.urandom(1024)
    with SegmentLog(tmp_path) as log:
        start = time.perf_counter()
        for _ in range(10_000):
            log.append(record)
        elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed


# --------------------------------------------------------------------------- torn tails


def _write_three(directory: Path, last: bytes = b"the last record, torn") -> list[bytes]:
    records = [b"one", b"two" * 10, last]
    with SegmentLog(directory, fsync="never") as log:
        log.append_many(records)
    return records


def test_torn_tail_at_every_offset(tmp_path: Path) -> None:
    records = _write_three(tmp_path)
    (path,) = segments(tmp_path)
    intact = path.read_bytes()
    last_start = len(intact) - HEADER_SIZE - len(records[-1])
    for cut in range(last_start, len(intact)):
        path.write_bytes(intact[:cut])
        with SegmentLog(tmp_path, fsync="never") as log:
            assert list(log.replay()) == [(0, records[0]), (1, records[1])], cut
            torn = log.statistics()["torn_tail_discarded"]
            assert torn == (1 if cut > last_start else 0), cut
            assert path.stat().st_size == last_start  # cut back to good data
            assert log.append(b"new") == 2
        assert replayed(tmp_path, fsync="never") == [(0, records[0]), (1, records[1]), (2, b"new")]


def test_torn_only_record_of_a_fresh_segment(tmp_path: Path) -> None:
    with SegmentLog(tmp_path, segment_bytes=64) as log:
        log.append_many([b"a" * 30, b"b" * 30])  # the second one opens segment 1
    last = segments(tmp_path)[-1]
    assert last.name == f"{1:020d}.seg"
    os.truncate(last, 10)
    with SegmentLog(tmp_path, segment_bytes=64) as log:
        assert [s for s, _ in log.replay()] == [0]
        assert last.stat().st_size == 0
        assert log.append(b"c") == 1  # continues from the empty segment's name
    assert [p for _, p in replayed(tmp_path)] == [b"a" * 30, b"c"]


def test_flipped_byte_in_last_record_is_discarded(tmp_path: Path) -> None:
    records = _write_three(tmp_path)
    (path,) = segments(tmp_path)
    intact = path.read_bytes()
    last_start = len(intact) - HEADER_SIZE - len(records[-1])
    for offset in range(last_start, len(intact)):
        path.write_bytes(intact)
        flip(path, offset)
        with SegmentLog(tmp_path, fsync="never") as log:
            assert [p for _, p in log.replay()] == records[:2], offset
            assert log.statistics()["torn_tail_discarded"] == 1


def test_flipped_byte_in_an_older_segment_is_an_error(tmp_path: Path) -> None:
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        log.append_many([b"p" * 30] * 6)
    middle = segments(tmp_path)[1]
    flip(middle, HEADER_SIZE + 50 + 3)  # a payload byte of its second record
    with pytest.raises(LogCorrupt, match=middle.name) as info:
        SegmentLog(tmp_path)
    assert info.value.path == str(middle) and info.value.offset == 50
    assert "checksum" in str(info.value)
    # The directory is left as it was for a human to look at, and unlocked.
    assert middle.stat().st_size == 100
    with pytest.raises(LogCorrupt):
        SegmentLog(tmp_path)


def test_damage_inside_the_last_segment_is_an_error(tmp_path: Path) -> None:
    """A bad record that intact records follow is not a torn write: never truncate it away."""
    records = _write_three(tmp_path)
    (path,) = segments(tmp_path)
    flip(path, HEADER_SIZE + len(records[0]) + HEADER_SIZE + 1)  # inside record 1 of 3
    before = path.read_bytes()
    with pytest.raises(LogCorrupt, match="intact records follow"):
        SegmentLog(tmp_path)
    assert path.read_bytes() == before


def test_missing_segment_is_an_error(tmp_path: Path) -> None:
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        log.append_many([b"p" * 30] * 6)
    segments(tmp_path)[1].unlink()
    with pytest.raises(LogCorrupt, match="previous one ends"):
        SegmentLog(tmp_path)


def test_damage_after_open_is_caught_by_replay(tmp_path: Path) -> None:
    with SegmentLog(tmp_path) as log:
        log.append_many([b"a" * 10, b"b" * 10])
        flip(segments(tmp_path)[0], 5)
        with pytest.raises(LogCorrupt):
            list(log.replay())
        assert log.statistics()["corrupt_segments"] == 1


# --------------------------------------------------------------------------- release


def test_release_before(tmp_path: Path) -> None:
    payload = b"p" * 30  # two records per segment: segments start at 0, 2, 4, 6, 8
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        log.append_many([payload] * 9)
        names = lambda: [int(p.name[:20]) for p in segments(tmp_path)]  # noqa: E731
        assert names() == [0, 2, 4, 6, 8]
        assert log.release_before(0) == 0
        assert log.release_before(3) == 1  # segment 0 (seqs 0, 1); segment 2 still holds 2
        assert names() == [2, 4, 6, 8]
        assert log.release_before(4) == 1
        assert names() == [4, 6, 8] and log.first_seq == 4
        assert log.release_before(1000) == 2  # everything but the active segment
        assert names() == [8]
        assert [s for s, _ in log.replay()] == [8]
        assert log.statistics()["records"] == 1
        assert log.append(payload) == 9
    with SegmentLog(tmp_path, segment_bytes=100) as log:
        assert log.first_seq == 8 and log.next_seq == 10
        assert [s for s, _ in log.replay()] == [8, 9]


def test_release_everything_keeps_the_sequence(tmp_path: Path) -> None:
    with SegmentLog(tmp_path, segment_bytes=30) as log:
        log.append_many([b"x" * 10] * 3)  # one record per segment
        assert log.release_before(3) == 2
        assert log.statistics()["segments"] == 1
    with SegmentLog(tmp_path, segment_bytes=30) as log:
        assert log.append(b"y") == 3


# --------------------------------------------------------------------------- SIGKILL

# The payload of a record is a function of its sequence number, so the parent can check every
# replayed record byte for byte. Sizes span tiny, page-sized and multi-page records.
PAYLOAD_SRC = """
import hashlib

def payload(seq):
    size = (0, 7, 1000, 5000, 100_000)[seq % 5]
    block = hashlib.blake2b(seq.to_bytes(8, "little")).digest()
    return (block * (size // len(block) + 1))[:size]
"""

CHILD_SRC = PAYLOAD_SRC + textwrap.dedent(
    """
    import random, sys
    from relax.bus._log import SegmentLog

    directory, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    log = SegmentLog(directory, segment_bytes=256 << 10, fsync=mode)
    print("ready", log.next_seq, flush=True)
    rng = random.Random(seed)
    while True:
        start = log.next_seq
        if rng.random() < 0.3:
            last = log.append_many(payload(s) for s in range(start, start + rng.randint(1, 8)))
        else:
            last = log.append(payload(start))
        # Printed only after the append returned: each printed seq must survive the kill.
        sys.stdout.write("".join(f"{s}\\n" for s in range(start, last + 1)))
        sys.stdout.flush()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "mode"), [(1, "never"), (2, "checkpoint"), (3, "never")])
def test_sigkill_loses_no_returned_append(tmp_path: Path, seed: int, mode: str) -> None:
    namespace: dict[str, Any] = {}
    exec(PAYLOAD_SRC, namespace)
    payload = namespace["payload"]
    script = tmp_path / "child.py"
    script.write_text(CHILD_SRC)
    directory = tmp_path / "log"
    rng = random.Random(seed)
    for _round in range(3):  # each round restarts on the log the previous kill left behind
        child = subprocess.Popen(
            [sys.executable, str(script), str(directory), str(rng.randrange(1 << 30)), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        ready = child.stdout.readline()
        assert ready.startswith("ready"), child.stderr.read() if child.stderr else ""
        printed: list[int] = []
        target = rng.randint(50, 1500)
        while len(printed) < target:
            line = child.stdout.readline()
            assert line, f"child ended early: {child.stderr.read() if child.stderr else ''}"
            printed.append(int(line))
        os.kill(child.pid, signal.SIGKILL)
        rest = child.stdout.read()  # whatever it printed before it died
        printed += [int(line) for line in rest.split("\n")[:-1]]  # complete lines only
        assert child.wait() == -signal.SIGKILL
        child.stdout.close()
        if child.stderr:
            child.stderr.close()

        with SegmentLog(directory) as log:
            records = list(log.replay())
            stats = log.statistics()
        seqs = [s for s, _ in records]
        assert seqs == list(range(len(seqs)))
        assert set(printed) <= set(seqs), "a record whose append returned was lost"
        assert printed == list(range(int(ready.split()[1]), printed[-1] + 1))
        for seq, data in records:
            assert data == payload(seq), seq
        assert stats["corrupt_segments"] == 0


# --------------------------------------------------------------------------- model test


class LogMachine(RuleBasedStateMachine):
    """Random appends, reopens, crashes (truncated or damaged tails) and releases, checked
    against a dict of what must be in the log."""

    SEGMENT = 160

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="relax-log-"))
        self.log = self._open()
        self.model: dict[int, bytes] = {}
        self.next_seq = 0

    def _open(self) -> SegmentLog:
        return SegmentLog(self.dir, segment_bytes=self.SEGMENT, fsync="never")

    def teardown(self) -> None:
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(data=st.binary(max_size=200))
    def append(self, data: bytes) -> None:
        assert self.log.append(data) == self.next_seq
        self.model[self.next_seq] = data
        self.next_seq += 1

    @rule(batch=st.lists(st.binary(max_size=60), max_size=8))
    def append_many(self, batch: list[bytes]) -> None:
        assert self.log.append_many(batch) == self.next_seq + len(batch) - 1
        for data in batch:
            self.model[self.next_seq] = data
            self.next_seq += 1

    @rule()
    def reopen(self) -> None:
        self.log.close()
        self.log = self._open()

    def _last_segment(self) -> tuple[Path, list[tuple[int, int]]]:
        """The last segment and the (seq, end offset) of each record the model puts in it."""
        path = segments(self.dir)[-1]
        first, end, frames = int(path.name[:20]), 0, []
        for seq in range(first, self.next_seq):
            end += HEADER_SIZE + len(self.model[seq])
            frames.append((seq, end))
        return path, frames

    def _forget_from(self, seq: int) -> None:
        for s in range(seq, self.next_seq):
            del self.model[s]
        self.next_seq = seq

    @rule(fraction=st.floats(0, 1))
    def crash_truncated(self, fraction: float) -> None:
        self.log.close()  # fsync="never": closing writes nothing, exactly like dying
        path, frames = self._last_segment()
        size = path.stat().st_size
        cut = round(size * fraction)
        os.truncate(path, cut)
        survivors = [seq for seq, end in frames if end <= cut]
        torn = cut not in {0, *(end for _, end in frames)}
        self._forget_from(survivors[-1] + 1 if survivors else int(path.name[:20]))
        self.log = self._open()
        discarded = self.log.statistics()["torn_tail_discarded"]
        if cut > (frames[-1][1] if frames else 0):
            # Past the data: a recycled segment's leftovers (the file was a released one). An
            # intact old record there is cut off as stale, one the cut went through as a torn
            # tail; either way nothing of them is replayed (replay_matches_model).
            assert discarded in (0, 1)
            assert path.stat().st_size == (frames[-1][1] if frames else 0)  # leftovers gone
        else:
            assert discarded == int(torn)

    @rule(offset=st.integers(0, 10_000))
    def crash_damaged_last(self, offset: int) -> None:
        self.log.close()
        path, frames = self._last_segment()
        if not frames:
            self.log = self._open()
            return
        start = frames[-2][1] if len(frames) > 1 else 0
        flip(path, start + offset % (frames[-1][1] - start))
        self._forget_from(frames[-1][0])
        self.log = self._open()
        assert self.log.statistics()["torn_tail_discarded"] == 1

    @rule(fraction=st.floats(0, 1.2))
    def release(self, fraction: float) -> None:
        first = self.log.first_seq
        seq = first + int((self.next_seq - first) * fraction)
        self.log.release_before(seq)
        names = [int(p.name[:20]) for p in segments(self.dir)]
        # Deleted: only segments wholly below seq. Kept: the first one is needed or active.
        assert names[0] == self.log.first_seq
        assert len(names) == 1 or names[1] > seq
        assert self.log.first_seq <= max(seq, first)
        for s in range(first, self.log.first_seq):
            del self.model[s]

    @invariant()
    def replay_matches_model(self) -> None:
        assert list(self.log.replay()) == sorted(self.model.items())
        assert self.log.next_seq == self.next_seq
        assert self.log.statistics()["records"] == len(self.model)

    @invariant()
    def segments_respect_their_size(self) -> None:
        for path in segments(self.dir)[:-1]:
            size = path.stat().st_size
            assert size <= self.SEGMENT or self._single_record(path, size)

    @staticmethod
    def _single_record(path: Path, size: int) -> bool:
        return int.from_bytes(path.read_bytes()[4:8], "little") + HEADER_SIZE == size


LogMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_log_model = LogMachine.TestCase


def test_a_record_may_be_given_as_parts_written_back_to_back(tmp_path):
    big = bytes(range(256)) * 512  # over the coalescing threshold: written by reference
    with SegmentLog(tmp_path) as log:
        log.append_many([[b"ab", memoryview(b"cd")], b"ef", [big, b"!"], [b"", b"x"]])
    with SegmentLog(tmp_path) as log:
        assert [r for _, r in log.replay()] == [b"abcd", b"ef", big + b"!", b"x"]


def test_released_segments_are_recycled_and_their_leftovers_never_replayed(tmp_path: Path) -> None:
    payload = lambda i: bytes([i % 251]) * 3000  # noqa: E731
    with SegmentLog(tmp_path, segment_bytes=10_000) as log:
        for i in range(12):  # 3 records a segment
            log.append(payload(i))
        assert log.release_before(9) == 3
        assert log.statistics()["spares"] == 2  # two kept for reuse, the third deleted
        for i in range(12, 15):  # new segments come from the spares, over old records
            log.append(payload(i))
        assert log.statistics()["spares"] == 1
    assert [s for s, _ in replayed(tmp_path)] == list(range(9, 15))
    # A crash right after a recycled segment started: its old records must not count.
    with SegmentLog(tmp_path, segment_bytes=10_000) as log:
        log.append(payload(15))
    active = segments(tmp_path)[-1]
    with open(active, "r+b") as f:  # recycle by hand: a segment whose tail is older records
        f.seek(0, 2)
        f.write(segments(tmp_path)[0].read_bytes())
    got = replayed(tmp_path)
    assert [s for s, _ in got] == list(range(9, 16)) and got[-1][1] == payload(15)
    with SegmentLog(tmp_path, segment_bytes=10_000) as log:
        assert log.append(b"next") == 16
    assert replayed(tmp_path)[-1] == (16, b"next")
