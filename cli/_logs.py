"""`relax logs`: read a run's structured logs as readable lines, and follow them.

Where the lines come from: ``RUN_DIR/logs/<actor-id>.jsonl`` (one file per actor, JSON objects
with ``timestamp``, ``level``, ``event``, ``actor``, ``pid`` and any other keys) and
``RUN_DIR/logs/cluster.jsonl`` (lines no actor logged). A run without a ``logs/`` folder falls
back to ``RUN_DIR/up.log`` (what a detached ``relax up --detach`` printed), split by the
``actor`` field of its JSON lines.

Without ACTOR, every actor's lines are interleaved by timestamp (like ``docker compose
logs``); ``--list`` shows which actors have logs. ACTOR is an actor id (``trainer``,
``rollout-0``, ``cluster``) or a role name standing for all its replicas (``rollout`` for
``rollout-0``, ``rollout-1``, ...).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from relax.cli._app import app
from relax.cli._runs import RunDirOption, cluster_running, resolve_run_dir

LOGS_DIR = "logs"
CLUSTER_LOG = "cluster"
"""Stem of the file holding lines without an actor (``logs/cluster.jsonl``)."""
UP_LOG = "up.log"

LEVELS = ("debug", "info", "warning", "error", "critical")
_LEVEL_STYLE = {
    "debug": {"dim": True},
    "info": {"fg": "green"},
    "warning": {"fg": "yellow", "bold": True},
    "error": {"fg": "red", "bold": True},
    "critical": {"fg": "white", "bg": "red", "bold": True},
}
_LEVEL_LABEL = {"warning": "WARN", "critical": "CRIT"}
_ACTOR_COLORS = ("cyan", "magenta", "blue", "yellow", "green", "bright_cyan", "bright_magenta")
_SHOWN_ELSEWHERE = {"timestamp", "level", "event", "actor", "pid", "exception"}
POLL_S = 0.25
"""How often ``--follow`` looks for new lines."""


def level_rank(level: str | None) -> int:
    """Position of a level name in LEVELS (unknown names count as info)."""
    name = (level or "info").lower()
    name = {"warn": "warning", "fatal": "critical", "exception": "error"}.get(name, name)
    return LEVELS.index(name) if name in LEVELS else 1


def parse_line(line: str) -> dict[str, Any] | None:
    """A log line as a record: its JSON object, or None for a line that is not one."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _clock(timestamp: Any) -> str:
    """``HH:MM:SS.mmm`` in local time from an ISO timestamp (UTC ``...Z``); as given otherwise."""
    if not isinstance(timestamp, str) or not timestamp:
        return " " * 12
    try:
        moment = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return timestamp
    if moment.tzinfo is not None:
        moment = moment.astimezone()
    return moment.strftime("%H:%M:%S.%f")[:-3]


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value if value and not any(c in value for c in " \t\n=\"'") else json.dumps(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value, separators=(",", ":"), default=str)


def actor_color(actor: str) -> str:
    """A stable color per actor id, so one actor's lines stand out when interleaved."""
    return _ACTOR_COLORS[zlib.crc32(actor.encode()) % len(_ACTOR_COLORS)]


def format_record(record: dict[str, Any], *, actor_width: int = 10, color: bool = True) -> str:
    """One record as ``time level actor event key=value ...`` (plus an indented traceback)."""
    level = str(record.get("level", "info")).lower()
    actor = str(record.get("actor") or CLUSTER_LOG)
    event = str(record.get("event", ""))
    extras = " ".join(
        f"{key}={_value(value)}"
        for key, value in record.items()
        if key not in _SHOWN_ELSEWHERE and not key.startswith("_")
    )
    level_text = f"{_LEVEL_LABEL.get(level, level.upper()[:5]):<5}"
    actor_text = f"{actor:<{actor_width}}"
    if color:
        level_text = typer.style(level_text, **_LEVEL_STYLE.get(level, {}))
        actor_text = typer.style(actor_text, fg=actor_color(actor))
        event = typer.style(event, bold=level_rank(level) >= 2)
        extras = typer.style(extras, dim=True) if extras else extras
    line = f"{_clock(record.get('timestamp'))} {level_text} {actor_text} {event}"
    if extras:
        line += f"  {extras}"
    exception = record.get("exception")
    if exception:
        line += "\n" + "\n".join(f"    {row}" for row in str(exception).rstrip().splitlines())
    return line


# --------------------------------------------------------------------------- sources


@dataclass
class Source:
    """One log file and where we are in it (for ``--follow``)."""

    path: Path
    actor: str | None
    """The actor every line of the file belongs to; None for up.log (each line says)."""
    offset: int = 0
    partial: bytes = b""
    last_timestamp: str = field(default="")

    def record(self, line: str) -> dict[str, Any]:
        record = parse_line(line)
        if record is None:  # a plain line (a traceback, a library's print): keep it readable
            record = {"event": line.rstrip(), "level": "info"}
        if self.actor is not None and self.actor != CLUSTER_LOG:
            record.setdefault("actor", self.actor)
        timestamp = record.get("timestamp")
        if isinstance(timestamp, str) and timestamp:
            self.last_timestamp = timestamp
        else:  # keep it next to the line before it when sorting
            record["_sort"] = self.last_timestamp
        return record

    def read_new(self) -> list[dict[str, Any]]:
        """Complete lines appended since the last read (a truncated file starts over)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = self.partial + f.read(size - self.offset)
        self.offset = size
        *lines, self.partial = data.split(b"\n")
        return [self.record(raw.decode("utf-8", "replace")) for raw in lines if raw.strip()]

    def tail(self, n: int) -> list[dict[str, Any]]:
        """The last ``n`` lines (all when ``n`` is 0); moves the follow position to the end."""
        if not self.path.exists():
            return []
        lines, self.partial, self.offset = last_lines(self.path, n)
        return [self.record(line.decode("utf-8", "replace")) for line in lines if line.strip()]


def last_lines(path: Path, n: int, block: int = 65536) -> tuple[list[bytes], bytes, int]:
    """The last ``n`` complete lines of ``path`` (all when ``n`` is 0), the unfinished line
    after them (a writer is still on it) and the size read; large files are read backwards."""
    with path.open("rb") as f:
        size = position = f.seek(0, os.SEEK_END)
        data = b""
        while position > 0 and (n == 0 or data.count(b"\n") <= n):
            step = min(block, position)
            position -= step
            f.seek(position)
            data = f.read(step) + data
    *complete, partial = data.split(b"\n")
    if position > 0:  # the first piece starts mid-line
        complete = complete[1:]
    return (complete[-n:] if n else complete), partial, size


def sources(run_dir: Path) -> list[Source]:
    """The run's log files: ``logs/*.jsonl`` (one per actor), else ``up.log``."""
    folder = run_dir / LOGS_DIR
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    if files:
        return [Source(path, path.stem) for path in files]
    if (run_dir / UP_LOG).is_file():
        return [Source(run_dir / UP_LOG, None)]
    return []


def matches(actor: str, wanted: str) -> bool:
    """``wanted`` is the actor id, or its role name (``rollout`` for ``rollout-3``)."""
    if actor == wanted:
        return True
    head, _, tail = actor.rpartition("-")
    return head == wanted and tail.isdigit()


def _actor_of(record: dict[str, Any]) -> str:
    return str(record.get("actor") or CLUSTER_LOG)


def known_actors(run_dir: Path, found: list[Source]) -> list[str]:
    """Actor ids with logs (for up.log: the ids its lines name)."""
    actors: set[str] = set()
    for source in found:
        if source.actor is not None:
            actors.add(source.actor)
        else:
            lines = source.path.read_text(errors="replace").splitlines()
            actors.update(_actor_of(r) for r in map(parse_line, lines) if r is not None)
    return sorted(actors)


def _sort_key(record: dict[str, Any]) -> str:
    timestamp = record.get("timestamp")
    return timestamp if isinstance(timestamp, str) and timestamp else record.get("_sort", "")


def merge(groups: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Interleave per-file record lists by timestamp (a stable sort keeps file order on ties)."""
    merged = [r for group in groups for r in group]
    merged.sort(key=_sort_key)
    return merged


def _select(
    records: Iterable[dict[str, Any]], wanted: str | None, min_level: int
) -> Iterator[dict[str, Any]]:
    for record in records:
        if wanted is not None and not matches(_actor_of(record), wanted):
            continue
        if level_rank(record.get("level")) < min_level:
            continue
        yield record


def _complete_actor(ctx: typer.Context, incomplete: str) -> list[str]:
    """Actor ids (and role names) of the run in --run-dir, or of the newest run."""
    from relax.cli._runs import newest_run

    run = ctx.params.get("run_dir") or newest_run()
    if run is None:
        return []
    try:
        actors = known_actors(Path(run), sources(Path(run)))
    except OSError:
        return []
    roles = {a.rpartition("-")[0] for a in actors if a.rpartition("-")[2].isdigit()}
    return sorted(n for n in set(actors) | roles if n.startswith(incomplete))


@app.command("logs")
def logs(
    actor: Annotated[
        str | None,
        typer.Argument(
            metavar="ACTOR",
            help="Only this actor (trainer, rollout-0, cluster) or role (rollout: every replica).",
            show_default=False,
            autocompletion=_complete_actor,
        ),
    ] = None,
    run_dir: RunDirOption = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep printing new lines until Ctrl-C or the cluster stops."
        ),
    ] = False,
    lines: Annotated[
        int,
        typer.Option("--lines", "-n", min=0, help="Show the last N lines first (0: all of them)."),
    ] = 50,
    level: Annotated[
        str,
        typer.Option(
            help="Only lines at this level or above: debug, info, warning, error.",
            case_sensitive=False,
        ),
    ] = "debug",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the raw JSON lines instead of formatting them.")
    ] = False,
    list_actors: Annotated[
        bool, typer.Option("--list", "-l", help="List the actors that have logs, and exit.")
    ] = False,
) -> None:
    """Show a run's logs: every actor's lines interleaved by time, or one actor's.

    Each line reads `time level actor event key=value ...`. The files are
    RUN_DIR/logs/<actor>.jsonl (lines without an actor: logs/cluster.jsonl), or RUN_DIR/up.log
    for a detached run without a logs/ folder.
    """
    if level.lower() not in LEVELS:
        typer.echo(f"unknown level {level!r}; use one of {', '.join(LEVELS[:4])}", err=True)
        raise typer.Exit(2)
    run = resolve_run_dir(run_dir)
    found = sources(run)
    if not found:
        typer.echo(
            f"no logs in {run}: no {LOGS_DIR}/*.jsonl and no {UP_LOG}. A run started in a "
            "terminal logs to that terminal; start one in the background with "
            "`relax up CLUSTER_TOML --detach` to keep its logs.",
            err=True,
        )
        raise typer.Exit(1)
    actors = known_actors(run, found)
    if list_actors:
        _list(run, found, actors)
        return
    if actor is not None and not any(matches(a, actor) for a in actors):
        typer.echo(
            f"no logs of {actor!r} in {run}; actors with logs: {', '.join(actors) or 'none'}",
            err=True,
        )
        raise typer.Exit(2)
    min_level = level_rank(level)
    width = max([len(a) for a in actors] + [8])
    color = None  # click strips the styles when stdout is not a terminal

    def show(records: Iterable[dict[str, Any]]) -> None:
        for record in _select(records, actor, min_level):
            if as_json:
                typer.echo(json.dumps({k: v for k, v in record.items() if k != "_sort"}))
            else:
                typer.echo(format_record(record, actor_width=width), color=color)

    wanted = [s for s in found if s.actor is None or actor is None or matches(s.actor, actor)]
    if lines == 0:
        show(merge(s.tail(0) for s in wanted))
    else:
        # up.log holds every actor: read enough of it to find N lines of the one asked for.
        depth = lines if actor is None or wanted[0].actor is not None else 0
        show(merge(s.tail(depth) for s in wanted)[-lines:])
    if not follow:
        return
    if not cluster_running(run):
        typer.echo(f"({run} is not running: nothing more to follow)", err=True)
        return
    with contextlib.suppress(KeyboardInterrupt):
        _follow(run, wanted, actor, show)


def _follow(run: Path, wanted: list[Source], actor: str | None, show: Any) -> None:
    known = {s.path for s in wanted}
    while True:
        running = cluster_running(run)
        for source in sources(run):  # actors that started logging since
            if source.path not in known and (
                source.actor is None or actor is None or matches(source.actor, actor)
            ):
                known.add(source.path)
                wanted.append(source)
        show(merge(s.read_new() for s in wanted))
        if not running:  # read once more after it stopped, then end
            typer.echo(f"({run.name} stopped)", err=True)
            return
        time.sleep(POLL_S)


def _list(run: Path, found: list[Source], actors: list[str]) -> None:
    if found[0].actor is None:
        typer.echo(f"actors in {found[0].path}: {', '.join(actors)}")
        return
    typer.echo(f"{'ACTOR':<16} {'SIZE':>9}  LAST LINE AT")
    for source in found:
        size = source.path.stat().st_size
        last = source.tail(1)
        when = _clock(last[-1].get("timestamp")) if last else "-"
        typer.echo(f"{source.actor or '-':<16} {_size(size):>9}  {when}")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
