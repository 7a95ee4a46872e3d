"""Offline audits of a finished run: its samples bus log, the trainer's ledger, its metrics
and its captured logs.

The samples bus appends every change (puts, columns, leases, acks, drops, versions) to its log
before it answers anyone, so replaying that log after the run tells exactly what happened to
every row, however often the roles around it were killed (as ``tests/bus/test_exactly_once.py``
does for a bare producer and consumer). The bus log alone cannot tell whether the trainer
really trained each row once (a bus that exposed weights without logging their rows' ack
looked clean in its own log), so ``check_trainer_ledger`` holds it against the trainer's own
record of which rows each surviving step consumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from relax.bus import BusTable, SegmentLog
from relax.log import ENV_FORMAT, ENV_LEVEL, configure_logging
from relax.transport import loads


def _plain(value: Any) -> Any:
    to_torch = getattr(value, "to_torch", None)
    return to_torch().tolist() if to_torch is not None else value


@dataclass
class BusLedger:
    """What the samples bus log says happened to each row."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    """uid -> the row as first put (group, version, columns)."""
    puts: Counter[str] = field(default_factory=Counter)
    """uid -> how many logged put records carried it (the bus deduplicates: must be 1)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """uid -> the reward column written for it."""
    components: dict[str, dict[str, float]] = field(default_factory=dict)
    """uid -> the named reward components written with its reward (when it had any)."""
    acks: dict[str, Counter[str]] = field(default_factory=dict)
    """task -> uid -> how many times it was acked (must be at most 1)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """uid -> reason its group was dropped ("stale", "reward_failed", ...)."""
    dropped_on_arrival: set[str] = field(default_factory=set)
    """Rows put after the rest of their group was dropped (dropped at once, with the group)."""
    drop_ops: list[dict[str, Any]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Trainer versions, in the order the bus recorded them (one per committed weights)."""
    commits: list[int] = field(default_factory=list)
    """Weight versions committed (each with its rows' ack, in one record), in log order."""
    pending: set[str] = field(default_factory=set)
    """Rows still on the bus when the run ended."""
    counters: Counter[str] = field(default_factory=Counter)
    records: int = 0

    def acked(self, task: str) -> Counter[str]:
        return self.acks.get(task, Counter())

    @property
    def trained(self) -> set[str]:
        return set(self.acked("train"))

    def dropped_for(self, reason: str) -> set[str]:
        return {uid for uid, why in self.dropped.items() if why == reason}

    def summary(self) -> dict[str, int]:
        reasons = Counter(self.dropped.values())
        return {
            "put": len(self.rows),
            "trained": len(self.trained),
            "pending": len(self.pending - self.trained),
            "dropped_on_arrival": len(self.dropped_on_arrival),
            **{f"dropped_{reason}": n for reason, n in sorted(reasons.items())},
            "expired_leases": self.counters["expired_leases"],
            "reclaimed_leases": self.counters["reclaimed_leases"],
            "duplicate_puts": self.counters["duplicate_puts"],
            "ignored_acks": self.counters["ignored_acks"],
        }


def bus_ops(run_dir: Path, bus: str = "samples") -> list[dict[str, Any]]:
    """Every op ``run_dir``'s ``bus`` logged, in order (the bus must be stopped)."""
    with SegmentLog(run_dir / bus / "bus-log") as log:
        return [loads(record) for _, record in log.replay()]


def _record_reward(ledger: BusLedger, uid: str, columns: dict) -> None:
    ledger.rewards[uid] = float(columns["reward"])
    if columns.get("reward_components"):
        ledger.components[uid] = columns["reward_components"]


def replay_samples_bus(run_dir: Path, bus: str = "samples") -> BusLedger:
    """Replay ``run_dir/samples/bus-log`` (the bus must be stopped) into a ``BusLedger``
    (``bus="prompts"``: the prompts bus, whose one task is ``"rollout"``)."""
    ledger = BusLedger()
    with SegmentLog(run_dir / bus / "bus-log") as log:
        # Compaction deletes whole old segments; a per-row audit needs every record.
        assert log.first_seq == 0, f"the bus log was compacted (first seq {log.first_seq})"
        ops = [(seq, loads(record)) for seq, record in log.replay()]
    # The consumer tasks ("reward", "train", and "reference"/"critic" when enabled).
    tasks = {"train"} | {op["task"] for _, op in ops if op.get("task")}
    table = BusTable(tasks=tuple(sorted(tasks)), capacity=1 << 30, staleness=math.inf)
    for seq, op in ops:
        ledger.records += 1
        kind = op["op"]
        if kind == "put":
            for row in op["rows"]:
                uid = row["uid"]
                ledger.puts[uid] += 1
                if uid not in ledger.rows:
                    cols = {k: _plain(v) for k, v in (row.get("columns") or {}).items()}
                    ledger.rows[uid] = {**row, "columns": cols}
                    if "reward" in cols:  # scored by its rollout ([reward] in_rollout)
                        _record_reward(ledger, uid, cols)
                if row["group"] in table.dropped_groups:
                    ledger.dropped_on_arrival.add(uid)
        elif kind == "columns" and "reward" in op["columns"]:
            _record_reward(ledger, op["uid"], {k: _plain(v) for k, v in op["columns"].items()})
        elif kind == "ack":
            acked = ledger.acks.setdefault(op["task"], Counter())
            for uid, _attempt in op["items"]:
                acked[uid] += 1
        elif kind == "drop":
            ledger.drop_ops.append(op)
            for uid in op["uids"]:
                ledger.dropped.setdefault(uid, op["reason"])
        elif kind == "version":
            ledger.versions.append(int(op["version"]))
        elif kind == "commit":
            ledger.commits.append(int(op["version"]))
            if op["set_version"] and op["version"] > table.version:  # v0 moves nothing
                ledger.versions.append(int(op["version"]))
            if op["items"]:
                acked = ledger.acks.setdefault(op["task"], Counter())
                for uid, _attempt in op["items"]:
                    acked[uid] += 1
            if op.get("drop"):
                ledger.drop_ops.append(op["drop"])
                for uid in op["drop"]["uids"]:
                    ledger.dropped.setdefault(uid, op["drop"]["reason"])
        table.apply(op, seq)
    ledger.pending = set(table.rows)
    ledger.counters = table.counters
    return ledger


def check_exactly_once(ledger: BusLedger) -> None:
    """Zero samples lost, zero trained twice, and every drop has a reason."""
    twice = {uid: n for uid, n in ledger.puts.items() if n != 1}
    assert not twice, f"rows put more than once: {twice}"
    for task, acked in ledger.acks.items():
        again = {uid: n for uid, n in acked.items() if n != 1}
        assert not again, f"rows acked by {task!r} more than once: {again}"
        unknown = set(acked) - set(ledger.rows)
        assert not unknown, f"{task!r} acked rows never put: {sorted(unknown)[:5]}"
    trained = ledger.trained
    dropped = set(ledger.dropped) | ledger.dropped_on_arrival
    pending = ledger.pending - trained
    assert not trained & dropped, f"rows trained and dropped: {sorted(trained & dropped)[:5]}"
    assert not pending & dropped, f"dropped rows still on the bus: {sorted(pending & dropped)[:5]}"
    vanished = set(ledger.rows) - trained - dropped - pending
    assert not vanished, f"{len(vanished)} rows vanished, e.g. {sorted(vanished)[:5]}"
    assert all(why for why in ledger.dropped.values()), "a drop without a reason"
    # Groups leave whole: a group is never half trained, half dropped.
    by_group: dict[str, set[str]] = {}
    for uid, row in ledger.rows.items():
        by_group.setdefault(row["group"], set()).add(uid)
    for group, uids in by_group.items():
        if uids & trained:
            assert not uids & dropped, f"group {group} was partly trained, partly dropped"


# --------------------------------------------------------------------------- the trainer's ledger


def check_no_lease_expired(run_dir: Path, ledger: BusLedger) -> None:
    """On both buses, every dead role's leases came back by its successor's reclaim, none by
    the lease timeout; a take still waiting for the dead one leased it nothing."""
    assert ledger.counters["expired_leases"] == 0, ledger.summary()
    prompts = replay_samples_bus(run_dir, bus="prompts")
    assert prompts.counters["expired_leases"] == 0, prompts.summary()


def read_trainer_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's ``trainer-ledger.jsonl``: per step, the ``[uid, attempt]`` it consumed."""
    path = run_dir / "trainer-ledger.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def check_trainer_ledger(run_dir: Path, ledger: BusLedger) -> dict[str, int]:
    """The trainer's own evidence against the bus log: the steps that survive in the final
    weights' lineage are 1..N, each once; no row was used by two of them; every row they used
    was acked (with its commit) by the bus, and every row the bus acked for training was
    consumed by a step the ledger records (applied, or skipped). Returns a summary."""
    entries = read_trainer_ledger(run_dir)
    final = max(ledger.commits, default=0)
    if ledger.commits:
        contiguous = list(range(ledger.commits[0], final + 1))
        assert ledger.commits == contiguous, f"weight versions with gaps: {ledger.commits}"
    applied = [e for e in entries if e["applied"]]
    steps = [e["step"] for e in applied]
    assert steps == sorted(set(steps)), f"a step recorded twice in the ledger: {steps}"
    lineage = [e for e in applied if e["step"] <= final]
    assert [e["step"] for e in lineage] == list(range(1, final + 1)), (
        f"the final weights v{final} do not descend from steps 1..{final}: "
        f"{[e['step'] for e in lineage]}"
    )
    used: dict[str, int] = {}
    for entry in lineage:
        for uid, _attempt in entry["items"]:
            assert uid not in used, f"{uid} trained twice: by step {used[uid]} and {entry['step']}"
            used[uid] = entry["step"]
    acked = ledger.trained
    unacked = set(used) - acked
    assert not unacked, (
        f"{len(unacked)} rows trained into the final weights but never acked, "
        f"e.g. {sorted(unacked)[:5]}"
    )
    consumed = set(used) | {u for e in entries if not e["applied"] for u, _ in e["items"]}
    lost = acked - consumed
    assert not lost, (
        f"{len(lost)} rows acked for training but no step used them: {sorted(lost)[:5]}"
    )
    return {"steps": len(lineage), "rows_trained": len(used), "entries": len(entries)}


def check_stopped_run(run_dir: Path) -> int:
    """The audit of a run stopped mid-way (``stop`` on the control endpoint): steps 1..N
    applied, zero rows lost or trained twice by the bus log, the trainer's ledger agrees, and
    the trainer's side replays from its record bit for bit (``relax replay``). Returns N."""
    records = read_metrics(run_dir)
    steps = max(r["step"] for r in records if r["applied"])
    check_metrics(records, steps)
    ledger = replay_samples_bus(run_dir)
    check_exactly_once(ledger)
    assert check_trainer_ledger(run_dir, ledger)["steps"] == steps
    check_replays_identically(run_dir, steps)
    return steps


def check_replays_identically(run_dir: Path, steps: int, *, regenerate: bool = True) -> None:
    """``relax replay`` of the run re-executes its ``steps`` applied steps bit for bit; with
    ``regenerate`` (runs without agents) every trained row is generated again, identically."""
    from relax.replay import replay

    report = replay(run_dir, regenerate=regenerate)
    assert report.identical, report.divergences[:3]
    assert report.applied == steps, report
    if regenerate:
        regen = report.regenerated
        assert regen is not None and regen.rows > 0 and regen.unrecorded == 0, regen
        assert regen.identical == regen.rows, regen


# --------------------------------------------------------------------------- metrics


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a run's JSON-lines file (``metrics.jsonl``, ``eval.jsonl``, ...), each line
    strictly parsed; none when it does not exist yet. Read while the run is going, the writer
    may be halfway through appending the last line: text after the last newline is not a
    record yet (a finished run's file ends with one; ``check_metrics`` counts every step, so a
    record that never got its newline is still caught)."""
    text = path.read_text() if path.exists() else ""
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's records, ``metrics.jsonl`` (see :func:`read_jsonl`)."""
    return read_jsonl(run_dir / "metrics.jsonl")


def applied_steps(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if r["applied"]]


def at_step(run: Any, run_dir: Path, n: int) -> bool:
    """Whether a run still going (``run``: its task) has applied ``n`` steps; raises what it
    raised, or that it ended first (a wait on it then fails at once, not at its timeout)."""
    if run.done():
        run.result()
        raise AssertionError(f"the run ended before step {n}")
    return len(applied_steps(run_dir)) >= n


def check_metrics(records: list[dict[str, Any]], steps: int) -> tuple[list[int], int]:
    """Versions never go backwards and every step 1..steps was applied.

    Returns ``(applied step numbers, redone)``: ``redone`` counts applied records repeated for
    the same step — a trainer killed after writing a step's record but before its weights were
    committed redoes that step from the last published weights.
    """
    applied = [r["step"] for r in records if r["applied"]]
    assert all(b >= a for a, b in itertools.pairwise(applied)), applied
    assert sorted(set(applied)) == list(range(1, steps + 1)), applied
    versions = [r["step"] for r in records]
    assert all(b >= a for a, b in itertools.pairwise(versions)), versions
    return applied, len(applied) - len(set(applied))


# --------------------------------------------------------------------------- logs


@contextlib.contextmanager
def captured_logs(path: Path, level: str = "info") -> Iterator[Path]:
    """Send every log line (of ``level`` and above) of this process and its children (JSON)
    to ``path``.

    Child processes inherit file descriptor 2 and the log format, so fd 2 points at the file
    for the duration; this process's structlog writes there through its own handle.
    """
    env = {name: os.environ.get(name) for name in (ENV_LEVEL, ENV_FORMAT)}
    with open(path, "a", buffering=1) as stream:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        saved = os.dup(2)
        os.dup2(fd, 2)
        configure_logging(level=level, fmt="json", stream=stream, force=True)
        try:
            yield path
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(fd)
            structlog.reset_defaults()
            configure_logging(force=True)
            for name, value in env.items():  # what children inherit goes back to what it was
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@dataclass
class LogLines:
    json: list[dict[str, Any]]
    """Structured (structlog JSON) lines."""
    text: list[str]
    """Every other line (stdlib ``logging`` warnings, progress bars)."""

    def events(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.json
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items())
        ]


def read_logs(path: Path) -> LogLines:
    structured, text = [], []
    for line in path.read_text(errors="replace").splitlines():
        value, rest = _json_line(line)
        if value is not None:
            structured.append(value)
        if rest.strip():
            text.append(rest)
    return LogLines(structured, text)


def _json_line(line: str) -> tuple[dict[str, Any] | None, str]:
    """The JSON object a log line holds, and the text before it. Every process appends to
    one file, and a child's progress bar (tqdm: no newline until it closes) can leave a
    partial line that another process's JSON line then continues: the object is recovered
    from where it starts, not lost."""
    start = line.find('{"')
    if start < 0:
        return None, line
    try:
        value, end = json.JSONDecoder().raw_decode(line, start)
    except ValueError:
        return None, line
    if not isinstance(value, dict) or line[end:].strip():
        return None, line
    return value, line[:start]


@contextlib.contextmanager
def hang_explained(log_file: Path) -> Iterator[None]:
    """A run that does not end fails with where its children hung: a child that does not stop
    when the tree is torn down writes its threads' stacks to the log before its SIGKILL."""
    try:
        yield
    except (TimeoutError, asyncio.TimeoutError):
        text = "\n".join(read_logs(log_file).text[-120:])
        raise AssertionError(f"the run did not end; the end of its log:\n{text}") from None
