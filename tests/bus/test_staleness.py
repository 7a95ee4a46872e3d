"""Staleness admission, property-tested with a discrete-event simulation over the real table.

Producers ask ``admit`` before generating a group (with the weights version they hold), take
``gen_time`` to generate it, then put it; the trainer takes ``batch_size`` rows, trains for
``train_time``, moves to the next version and the producers pick up the new weights. Speeds are
random (hypothesis). Whatever they are, the trainer must only ever receive rows with
``version >= N - s``; with ``s = 0`` every batch is exactly on-policy; and when generation and
training take comparable time, more staleness never means fewer training steps.
"""

from __future__ import annotations

import heapq
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from relax.bus._table import BusTable

STALENESS = [0, 1, 3, math.inf]


def simulate(
    staleness: float,
    *,
    producers: int,
    gen_time: float,
    train_time: float,
    group_size: int,
    groups_per_batch: int,
    horizon: float,
    jitter: list[float],
    end_version: int | None = None,
    table_out: list[BusTable] | None = None,
) -> tuple[int, list[tuple[int, list[int]]], int]:
    """Run until ``horizon`` (or the trainer's ``end_version``); returns (training steps,
    [(trainer version, row versions)], rows dropped as stale)."""
    batch = group_size * groups_per_batch
    table = BusTable(
        tasks=("train",),
        capacity=64 * batch,
        staleness=staleness,
        batch_size=batch,
        end_version=end_version,
    )
    if table_out is not None:
        table_out.append(table)
    events: list[tuple[float, int, str, int]] = []  # (time, tiebreak, kind, producer)
    tick = 0

    def push(when: float, kind: str, who: int) -> None:
        nonlocal tick
        tick += 1
        heapq.heappush(events, (when, tick, kind, who))

    weights = [0] * producers  # the version each producer holds
    work: dict[int, tuple[str, int]] = {}
    serial = 0
    trainer_busy = False
    batches: list[tuple[int, list[int]]] = []
    for p in range(producers):
        push(0.0, "try", p)
    push(0.0, "train?", -1)
    while events:
        now, _, kind, who = heapq.heappop(events)
        if now > horizon:
            break
        if kind == "try":  # a producer asks for permission to generate a group
            if who in work:
                continue  # already generating (a wake-up and a finish can coincide)
            group = f"g{serial}"
            _, verdict = table.admit(group, group_size, weights[who], now=now, timeout=1e9)
            if verdict == "ok":
                serial += 1
                work[who] = (group, weights[who])
                push(now + gen_time * jitter[(serial + who) % len(jitter)], "done", who)
            elif verdict == "behind":
                weights[who] = table.version
                push(now, "try", who)
            # "ahead"/"full": wait for the trainer to move (woken below)
        elif kind == "done":
            group, version = work.pop(who)
            rows = [
                {
                    "uid": f"{group}/{i}",
                    "group": group,
                    "group_size": group_size,
                    "version": version,
                }
                for i in range(group_size)
            ]
            assert table.put(rows) is not None
            weights[who] = table.version  # pick up the newest weights between groups
            push(now, "try", who)
            push(now, "train?", -1)
        elif kind == "train?" and not trainer_busy and table.version != end_version:
            _, lease = table.take(
                "train", batch_size=batch, min_rows=batch, whole_groups=True, now=now
            )
            if lease is not None:
                trainer_busy = True
                batches.append((table.version, [table.rows[u].version for u in lease.items]))
                table.ack("train", list(lease.items.items()))
                push(now + train_time, "trained", -1)
        elif kind == "trained":
            trainer_busy = False
            table.set_version(table.version + 1)
            for p in range(producers):
                if p not in work:
                    weights[p] = table.version
                    push(now, "try", p)
            push(now, "train?", -1)
    return table.version, batches, table.counters["dropped_stale"]


speeds = st.fixed_dictionaries(
    {
        "producers": st.integers(1, 4),
        "gen_time": st.floats(0.5, 2.0),
        "train_time": st.floats(0.5, 2.0),
        "group_size": st.sampled_from([1, 2, 4]),
        "groups_per_batch": st.integers(1, 4),
        "jitter": st.lists(st.floats(0.5, 1.5), min_size=1, max_size=8),
    }
)


@settings(max_examples=60, deadline=None)
@given(speeds)
def test_trainer_only_ever_sees_rows_within_the_staleness_bound(params) -> None:
    for s in STALENESS:
        _, batches, wasted = simulate(s, horizon=60.0, **params)
        assert batches, "the trainer must make progress"
        if len(set(params["jitter"])) == 1:
            # No stragglers: pacing alone keeps every generated row fresh enough to train on.
            assert wasted == 0, (s, wasted)
        for version, row_versions in batches:
            assert min(row_versions) >= version - s, (s, version, row_versions)
            if s == 0:
                assert set(row_versions) == {version}  # strictly on-policy


@settings(max_examples=60, deadline=None)
@given(speeds)
def test_more_staleness_never_trains_slower(params) -> None:
    params = {**params, "jitter": [1.0]}  # comparable, steady speeds
    runs = [simulate(s, horizon=120.0, **params) for s in STALENESS]
    steps = [steps for steps, _, _ in runs]
    assert steps == sorted(steps), steps
    assert all(wasted == 0 for _, _, wasted in runs)
    if (
        params["gen_time"] * params["groups_per_batch"] / params["producers"]
        >= 0.5 * params["train_time"]
    ):
        # Generation is a real share of the step: overlapping it with training must pay off.
        assert steps[-1] > steps[0], steps


@settings(max_examples=60, deadline=None)
@given(speeds)
def test_nothing_is_generated_past_the_last_step_and_the_last_step_is_reached(params) -> None:
    """With the run's end known (``[trainer] steps``), every staleness — "inf" included, which
    generated until the bus was full — admits exactly the rows the remaining steps train."""
    params = {**params, "jitter": [1.0]}
    for s in STALENESS:
        tables: list[BusTable] = []
        steps, _, _ = simulate(s, horizon=1e6, end_version=6, table_out=tables, **params)
        batch = params["group_size"] * params["groups_per_batch"]
        assert steps == 6, (s, steps)  # no hang at the end
        assert tables[0].counters["put"] == 6 * batch, (s, tables[0].counters)
