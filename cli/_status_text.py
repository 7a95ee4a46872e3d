"""What ``relax status`` shows, as text: the formatting the live dashboard (``_tui``) and the
one-shot snapshot printed without a terminal share, so the two never disagree."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rich.text import Text

from relax.observe import last_eval
from relax.schema import (
    BusStatistics,
    ChildSnapshot,
    MetricRecord,
    StatusSnapshot,
    TreeSnapshot,
)

WINDOW = 10
"""How many recent applied steps the averages (step time, tokens/s) cover."""


def plain_snapshot(snap: StatusSnapshot) -> str:
    """One ``status`` reply as plain text (no escape codes): what ``relax status`` prints when
    its output is not a terminal — a pipe, a file, a CI log."""
    lines = [
        f"cluster {snap.get('cluster', '?')} · run folder {snap.get('run_dir', '?')} · "
        f"up {duration(snap.get('uptime_s'))}"
        + (" · generation PAUSED" if snap.get("paused") else "")
    ]
    if snap.get("metrics_url"):
        lines.append(f"metrics {snap['metrics_url']}")
    trainer = snap.get("trainer") or {}
    applied = [r for r in snap.get("metrics") or [] if r.get("applied")]
    last = applied[-1] if applied else {}
    recent = applied[-WINDOW:]
    lines.append(
        f"trainer version {trainer.get('version', '?')} · step {last.get('step', '—')} · "
        f"reward {fmt(last.get('reward_mean'))}{average(recent, 'reward_mean')} · "
        f"loss {fmt(last.get('loss'))}{average(recent, 'loss')}"
    )
    if snap.get("rollouts"):
        lines.append("rollouts " + rollouts_summary(snap["rollouts"]))
    evaluated = last_eval(snap["run_dir"]) if snap.get("run_dir") else None
    if evaluated is not None:
        lines.append(eval_summary(evaluated))
    tree = snap.get("tree") or {}
    lines.append(
        f"actors (supervisor {tree.get('id', '?')} · {tree.get('strategy', '?')}"
        + (f" · GAVE UP: {tree['gave_up']}" if tree.get("gave_up") else "")
        + ")"
    )
    rows = []
    for path, depth, child in flatten(tree):
        crash = child.get("last_crash") or {}
        cause = crash.get("description") or crash.get("message") or crash.get("kind") or "—"
        rows.append(
            (
                "  " * depth + str(path.rsplit("/", 1)[-1]),
                state_label(child),
                placement_label(child),
                "pids " + (",".join(str(p) for p in child.get("pids") or []) or "—"),
                "up " + duration(child.get("uptime_s")),
                f"restarts {int(child.get('restart_count') or 0)}",
                f"last crash {cause}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(7)] if rows else []
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    for name, stats in (snap.get("bus") or {}).items():
        if "error" in stats:
            lines.append(f"bus {name}: unavailable ({stats['error']})")
            continue
        lines += ["bus " + line for line in bus_summary(name, stats).plain.splitlines()]
        for task, counts in (stats.get("tasks") or {}).items():
            lines.append(
                f"  task {task}: pending {counts.get('pending', 0)} · leased "
                f"{counts.get('leased', 0)} · acked {counts.get('acked', 0)} · lag "
                f"{counts.get('lag', 0)}"
            )
    return "\n".join(lines)


def rollouts_summary(rollouts: dict[str, Any]) -> str:
    """``rollout-0 v41 · rollout-1 v40 (starting)``: the weights each replica serves."""
    parts = []
    for child, info in rollouts.items():
        if "error" in info:
            parts.append(f"{child} (not answering)")
        else:
            parts.append(f"{child} v{info.get('version', '?')}")
    return " · ".join(parts)


def eval_summary(record: dict[str, Any]) -> str:
    """The newest evaluation ([eval], ``RUN_DIR/eval.jsonl``) in one line."""
    k = record.get("eval/k")
    k_text = f"{int(k)}" if isinstance(k, (int, float)) else "k"
    text = (
        f"eval version {record.get('version', '?')} · reward {fmt(record.get('eval/mean_reward'))}"
        f" · pass@1 {fmt(record.get('eval/pass@1'))} · pass@{k_text} {fmt(record.get('eval/pass@k'))}"
    )
    skipped = record.get("eval/skipped_versions")
    if skipped:
        text += f" · {int(skipped)} due versions skipped"
    return text


def state_label(child: ChildSnapshot) -> str:
    """A child's state for a table: ``waiting for resources`` when no node can host it yet
    (the snapshot's ``waiting`` says what it asks for)."""
    state = str(child.get("state", "?"))
    return "waiting for resources" if state == "waiting" else state


def placement_label(child: ChildSnapshot) -> str:
    """Where a child runs: its placement, and for a Ray-placed one the node hosting it
    (``ray @ 127.0.0.1 node 1a2b3c4d``; a node id is 56 hex digits, 8 tell them apart); a gang
    spread over nodes names each (``ray @ 2 nodes: 1a2b3c4d, 5e6f7a8b``)."""
    placement = str(child.get("placement", ""))
    stats = child.get("stats") or {}
    members = stats.get("members") or [stats]  # a gang's stats are per member
    nodes = list(
        dict.fromkeys(
            (m.get("node_ip"), str(m["node_id"])[:8]) for m in members if m.get("node_id")
        )
    )
    if not nodes:
        return placement
    if len(nodes) > 1:
        return f"{placement} @ {len(nodes)} nodes: " + ", ".join(node for _, node in nodes)
    ip, node = nodes[0]
    return f"{placement} @ {f'{ip} ' if ip else ''}node {node}"


def flatten(
    tree: TreeSnapshot | ChildSnapshot, prefix: str = "", depth: int = 0
) -> Iterator[tuple[str, int, ChildSnapshot]]:
    """``(id path, depth, child)`` of every child of a supervisor snapshot, depth first."""
    for child in tree.get("children") or []:
        path = f"{prefix}{child.get('id')}"
        yield path, depth, child
        if child.get("children"):
            yield from flatten(child, f"{path}/", depth + 1)


def bus_summary(name: str, stats: BusStatistics) -> Text:
    """Two lines about one bus: capacity use, versions in flight, counters and drops."""
    text = Text()
    rows, capacity = int(stats.get("rows", 0)), int(stats.get("capacity") or 0)
    text.append(f"{name:<8}", style="bold")
    if capacity:
        use = rows / capacity
        filled = round(10 * min(use, 1.0))
        style = "red" if use >= 0.9 else "yellow" if use >= 0.6 else "green"
        text.append(f"rows {rows}/{capacity} ")
        text.append("█" * filled, style=style)
        text.append("░" * (10 - filled), style="dim")
        text.append(f" {use:.0%}")
    else:
        text.append(f"rows {rows}")
    in_flight = stats.get("versions_in_flight") or {}
    versions = ", ".join(f"v{v}: {n}" for v, n in sorted(in_flight.items(), key=_version_key))
    text.append(f"   versions in flight: {versions or '—'}")
    current = (stats.get("weights") or {}).get("current", -1)
    if current is not None and current >= 0:
        text.append(f"   weights v{current}")
    text.append("\n" + " " * 8)
    counters = stats.get("counters") or {}
    text.append(f"put {counters.get('put', 0)} · trained {counters.get('trained', 0)}")
    stale = int(counters.get("dropped_stale", 0))
    text.append(" · stale drops ")
    text.append(str(stale), style="bold yellow" if stale else "")
    others = {
        k: v
        for k, v in counters.items()
        if (k.startswith("dropped_") and k != "dropped_stale") or k.startswith("expired_")
    }
    for key, value in sorted(others.items()):
        text.append(f" · {key.replace('_', ' ')} ")
        text.append(str(value), style="yellow" if value else "")
    text.append("\n")
    return text


def _version_key(item: tuple[str, Any]) -> float:
    try:
        return float(item[0])
    except ValueError:
        return float("inf")


def average(records: list[MetricRecord], key: str) -> str:
    """``"  (avg X)"`` over ``records`` that have ``key`` (``""`` for fewer than two)."""
    values = [float(r[key]) for r in records if r.get(key) is not None]
    return f"  (avg {fmt(sum(values) / len(values))})" if len(values) > 1 else ""


def fmt(value: Any) -> str:
    """A metric value, short: four significant digits, ``—`` when missing."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def duration(value: Any) -> str:
    """Seconds as ``12.3s``, ``4m05s`` or ``2h07m`` (``—`` when missing)."""
    if value is None:
        return "—"
    value = float(value)
    if value < 60:
        return f"{value:.1f}s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def ago(value: float) -> str:
    return f"{duration(max(value, 0.0))} ago"
