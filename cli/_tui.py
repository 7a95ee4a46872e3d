"""The live dashboard of ``relax status``: a Textual app that polls a cluster's control endpoint.

::

    ┌─ banner: not reachable / stopped / generation paused (hidden while all is well) ─┐
    │ Actors: the supervisor tree              │ Trainer: version, step, generation,   │
    │   actor state placement pids uptime      │   reward, loss, kl/entropy, step      │
    │   restarts last-crash (state coloured)   │   time, tokens/s                      │
    │ Buses: pending/leased/acked/lag per task │ reward sparkline, its min/max and axis│
    │   capacity use, versions in flight,      │                                       │
    │   put/trained, stale and other drops     │ loss sparkline (constants at level)   │
    └─ footer: r restart (asks) · p pause/resume · +/- rollouts · s staleness · q quit ┘

Polling runs in a worker on the app's event loop (the control client is asynchronous), so the
UI never waits on the cluster; operator actions (restart, pause, resume, a rollout replica more
or less, a new staleness bound) run in workers too and trigger an immediate refresh. When the cluster cannot be reached the last snapshot stays on
screen under a banner that says why, and polling goes on: a cluster that is restarting (or that
someone brings back with ``relax up --resume``) reappears by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Header, Static

from relax.cli._runs import run_outcome
from relax.cli._status_text import (
    WINDOW,
    ago,
    average,
    bus_summary,
    duration,
    eval_summary,
    flatten,
    fmt,
    placement_label,
    seconds,
    state_label,
)
from relax.cli._tui_widgets import AskValue, AxisSparkline, Confirm
from relax.control import CONTROL_FILE, ClusterNotRunning, control_request
from relax.observe import last_eval
from relax.schema import BusStatistics, Staleness, StatusSnapshot, TreeSnapshot

STATE_STYLES = {
    "running": "bold green",
    "starting": "yellow",
    "restarting": "bold yellow",
    "waiting": "bold magenta",
    "stopping": "yellow",
    "exited": "yellow",
    "crashed": "bold red",
    "stopped": "red",
}
"""How each supervisor child state is coloured in the actors table."""

ACTOR_COLUMNS = ("actor", "state", "placement", "pids", "uptime", "restarts", "last crash")
TASK_COLUMNS = ("bus", "task", "pending", "leased", "acked", "lag")
SPARK_POINTS = 60
ROLLOUT_ID = re.compile(r"^rollout-\d+$")
"""How many recent applied steps the sparklines show."""
REWARD_RANGE = (0.0, 1.0)
"""The axis every reward sparkline includes: most rewards live in 0..1, so a constant 1.0 is
a full bar and a constant 0.0 a line at the floor (rewards outside it widen the axis)."""


class StatusApp(App[None]):
    """Live status of the cluster running in ``run_dir``, refreshed every ``interval`` seconds.

    ``snapshot`` holds the last ``status`` reply, ``connection`` one of ``connecting``,
    ``connected``, ``absent`` (no cluster has run here yet), ``unreachable`` (it does not
    answer), ``gone`` (its process died) and ``stopped`` (it shut down).
    """

    TITLE = "relax status"
    CSS = """
    #banner { height: auto; padding: 0 1; text-style: bold; }
    #banner.info { background: $primary 50%; }
    #banner.warn { background: $warning 50%; }
    #banner.error { background: $error 70%; }
    .title { background: $boost; text-style: bold; padding: 0 1; height: 1; }
    #main { height: 1fr; }
    #main.stale { opacity: 60%; }
    #left { width: 3fr; }
    #actors { height: auto; max-height: 60%; margin-bottom: 1; }
    #tasks { height: auto; max-height: 12; }
    #buses { height: auto; padding: 1 1 0 1; }
    #right { width: 2fr; min-width: 44; border-left: solid $primary 40%; }
    #trainer { height: auto; padding: 0 1 1 1; }
    .spark-label { height: auto; padding: 0 1; color: $text-muted; }
    AxisSparkline { height: 1fr; min-height: 3; margin: 0 1 1 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r", "restart", "Restart selected actor"),
        Binding("p", "toggle_pause", "Pause/resume generation"),
        Binding("plus,equals_sign", "scale(1)", "+1 rollout"),
        Binding("minus", "scale(-1)", "-1 rollout"),
        Binding("s", "set_staleness", "Set staleness"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        run_dir: str | Path,
        *,
        interval: float = 1.0,
        history: int = 100,
        request_timeout: float = 10.0,
        op_timeout: float = 120.0,
    ) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.interval, self.history = interval, history
        self.request_timeout, self.op_timeout = request_timeout, op_timeout
        self.snapshot: StatusSnapshot | None = None
        self.snapshot_at: float | None = None
        self.connection = "connecting"
        self.reason = ""
        self.paused: bool | None = None
        self.op_in_flight: str | None = None
        self.render_error = ""
        self.polls = 0
        self.outcome = ""
        """How the run stands when no cluster answers (``_runs.run_outcome``)."""
        self._poke = asyncio.Event()

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="banner")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield Static("Actors", classes="title", id="actors-title")
                yield DataTable(id="actors", cursor_type="row")
                yield Static("Buses", classes="title")
                yield DataTable(id="tasks", cursor_type="none")
                yield Static("", id="buses")
            with Vertical(id="right"):
                yield Static("Trainer", classes="title")
                yield Static("waiting for the first status…", id="trainer")
                yield Static("reward", classes="spark-label", id="reward-label")
                yield AxisSparkline(known=REWARD_RANGE, style="green", id="reward")
                yield Static("loss", classes="spark-label", id="loss-label")
                yield AxisSparkline(style="magenta", id="loss")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = str(self.run_dir)
        actors = self.query_one("#actors", DataTable)
        for column in ACTOR_COLUMNS:
            actors.add_column(column, key=column)
        tasks = self.query_one("#tasks", DataTable)
        for column in TASK_COLUMNS:
            tasks.add_column(column, key=column)
        self._show_banner()
        self.run_worker(self._poll_loop(), name="poll", group="poll", exclusive=True)

    # ------------------------------------------------------------------ polling

    async def _poll_loop(self) -> None:
        while True:
            self._poke.clear()
            await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self.interval)

    async def poll(self) -> None:
        """Ask the cluster for one status and show it (or show why it did not answer)."""
        payload = {"op": "status", "history": self.history}
        try:
            snapshot: StatusSnapshot = await control_request(
                self.run_dir, payload, timeout=self.request_timeout
            )
        except ClusterNotRunning as exc:
            self._lost(exc)
        except Exception as exc:  # a timeout, a torn connection: keep trying
            self.connection, self.reason = "unreachable", f"{type(exc).__name__}: {exc}"
        else:
            self.connection, self.reason = "connected", ""
            self.snapshot, self.snapshot_at = snapshot, time.time()
            if self.op_in_flight not in ("pause", "resume"):
                self.paused = bool(snapshot.get("paused"))
            try:
                self._render_snapshot(snapshot)
                self.render_error = ""
            except Exception as exc:  # a reply this version cannot show: say so, keep polling
                self.render_error = f"{type(exc).__name__}: {exc}"
        self.polls += 1
        self.query_one("#main").set_class(self.connection != "connected", "stale")
        self._show_banner()

    def _lost(self, exc: ClusterNotRunning) -> None:
        self.reason = str(exc)
        self.outcome = run_outcome(self.run_dir)[0]
        if (self.run_dir / CONTROL_FILE).exists():
            # control.json left behind: its process died (or does not answer yet)
            self.connection = "gone" if "is gone" in self.reason else "unreachable"
        else:  # removed on the way out: a clean stop, or no cluster ever ran here
            self.connection = "stopped" if self.snapshot is not None else "absent"

    def refresh_now(self) -> None:
        """Poll at once instead of at the next tick."""
        self._poke.set()

    # ------------------------------------------------------------------ banner

    def banner_text(self) -> tuple[str, str]:
        """The banner's text and level (``""`` when nothing needs saying)."""
        retry = f"retrying every {self.interval:g}s"
        stale = ""
        if self.snapshot_at is not None:
            stale = f"; showing the last status, from {ago(time.time() - self.snapshot_at)}"
        if self.connection == "connecting":
            return f"connecting to the cluster in {self.run_dir}…", "info"
        if self.connection == "absent":
            return (
                f"no running cluster in {self.run_dir}: start one with `relax up CLUSTER_TOML` "
                f"— {retry}\n{self.outcome}",
                "warn",
            )
        if self.connection == "stopped":
            version = self._trainer_version()
            at = f" at trainer version {version}" if version is not None else ""
            return (
                f"■ the cluster has stopped{at}; {retry} (`relax up CLUSTER_TOML --resume` "
                f"continues the run){stale}\n{self.outcome}",
                "error",
            )
        if self.connection == "gone":
            return (
                f"✖ the cluster's process died ({self.reason}); {retry} (it may be restarting)"
                f"{stale}",
                "error",
            )
        if self.connection == "unreachable":
            return (
                f"⚠ the cluster is not reachable ({self.reason}); {retry} (it may be restarting)"
                f"{stale}",
                "warn",
            )
        if self.render_error:
            return f"cannot show this status ({self.render_error})", "error"
        if self.op_in_flight == "pause":
            return "⏸ pausing generation: waiting for the rounds in flight to be put…", "info"
        if self.op_in_flight == "resume":
            return "▶ resuming generation…", "info"
        if self.op_in_flight == "scale":
            return "scaling the rollouts: a removed one finishes its round first…", "info"
        if self.paused:
            return "⏸ generation is PAUSED: the trainer only eats what is left (p resumes)", "warn"
        return "", ""

    def _show_banner(self) -> None:
        text, level = self.banner_text()
        banner = self.query_one("#banner", Static)
        banner.update(Text(text))  # plain: a reason or up.log line may hold "[...]"
        banner.set_classes(level)
        banner.display = bool(text)

    # ------------------------------------------------------------------ rendering

    def _render_snapshot(self, snap: StatusSnapshot) -> None:
        cluster = snap.get("cluster", "?")
        self.title = f"relax status · {cluster}"
        sub_title = f"{snap.get('run_dir', self.run_dir)} · up {duration(snap.get('uptime_s'))}"
        if snap.get("metrics_url"):
            sub_title += f" · {snap['metrics_url']}"
        self.sub_title = sub_title
        self._render_actors(snap.get("tree") or {})
        self._render_trainer(snap)
        self._render_buses(snap.get("bus") or {})

    def _render_actors(self, tree: TreeSnapshot) -> None:
        title = Text("Actors", style="bold")
        if tree:
            title.append(
                f"  supervisor {tree.get('id')} · {tree.get('strategy')} · restart intensity "
                f"{tree.get('intensity')} per {tree.get('period')}s",
                style="not bold",
            )
            if tree.get("gave_up"):
                title.append(f" · GAVE UP: {tree['gave_up']}", style="bold red")
        self.query_one("#actors-title", Static).update(title)
        table = self.query_one("#actors", DataTable)
        seen = []
        for path, depth, child in flatten(tree):
            seen.append(path)
            state = str(child.get("state", "?"))
            crash = child.get("last_crash") or {}
            cause = Text("—", style="dim")
            if crash:
                cause = Text(crash.get("description") or crash.get("message") or crash["kind"])
                cause.stylize("red")
                if crash.get("at"):
                    cause.append(f" ({ago(time.time() - crash['at'])})", style="dim")
            restarts = int(child.get("restart_count") or 0)
            cells = {
                "actor": Text("  " * depth + str(child.get("id")), style="bold"),
                "state": Text(state_label(child), style=STATE_STYLES.get(state, "")),
                "placement": placement_label(child),
                "pids": ",".join(str(p) for p in child.get("pids") or []) or "—",
                "uptime": duration(child.get("uptime_s")),
                "restarts": Text(str(restarts), style="bold yellow" if restarts else ""),
                "last crash": cause,
            }
            if path in table.rows:
                for column, value in cells.items():
                    table.update_cell(path, column, value, update_width=True)
            else:
                table.add_row(*(cells[c] for c in ACTOR_COLUMNS), key=path)
        for key in [k.value for k in table.rows if k.value not in seen]:
            table.remove_row(key)

    def _render_trainer(self, snap: StatusSnapshot) -> None:
        trainer = snap.get("trainer") or {}
        records = snap.get("metrics") or []
        applied = [r for r in records if r.get("applied")]
        last = applied[-1] if applied else {}
        recent = applied[-WINDOW:]
        skipped = sum(1 for r in records if not r.get("applied"))
        lines = Text()

        def row(label: str, value: str | Text, style: str = "") -> None:
            lines.append(f"{label:<12}", style="dim")
            lines.append(value if isinstance(value, Text) else Text(value, style=style))
            lines.append("\n")

        row("version", str(trainer.get("version", "?")), "bold")
        step = f"{last['step']}" if last else "—"
        if skipped:
            step += f"  ({skipped} of the last {len(records)} skipped)"
        row("step", step)
        generation = (
            Text("PAUSED", style="bold yellow") if self.paused else Text("running", style="green")
        )
        replicas = self.rollout_replicas()
        generation.append(f" · {replicas} rollout{'s' if replicas != 1 else ''}", style="")
        staleness = ((snap.get("bus") or {}).get("samples") or {}).get("staleness")
        if staleness is not None:
            generation.append(f" · staleness {staleness}", style="")
        row("generation", generation)
        rollouts = snap.get("rollouts") or {}
        if rollouts:  # the weights each replica serves: behind ones stand out
            versions = [i["version"] for i in rollouts.values() if "version" in i]
            silent = len(rollouts) - len(versions)
            served = "—"
            if versions:
                low, high = min(versions), max(versions)
                served = f"v{low}" if low == high else f"v{low} to v{high}"
            row("serving", served + (f"  ({silent} not answering)" if silent else ""))
        row("reward", fmt(last.get("reward_mean")) + average(recent, "reward_mean"))
        row("loss", fmt(last.get("loss")) + average(recent, "loss"))
        evaluated = last_eval(self.run_dir)
        if evaluated is not None:  # [eval]: the newest evaluation, from RUN_DIR/eval.jsonl
            row("eval", eval_summary(evaluated).removeprefix("eval "))
        kl = last.get("kl", last.get("approx_kl"))
        row("kl/entropy", f"{fmt(kl)} / {fmt(last.get('entropy'))}")
        times = [r["step_time_s"] for r in recent if r.get("step_time_s")]
        step_time = "—"
        if last.get("step_time_s"):
            step_time = seconds(last["step_time_s"])
            if times:
                step_time += f"  (avg {seconds(sum(times) / len(times))})"
        row("step time", step_time)
        with_tokens = [r for r in recent if r.get("tokens") and r.get("step_time_s")]
        rate = "—"
        if with_tokens:
            tokens = sum(r["tokens"] for r in with_tokens)
            rate = f"{tokens / sum(r['step_time_s'] for r in with_tokens):,.0f}"
        row("tokens/s", rate)
        lines.rstrip()
        self.query_one("#trainer", Static).update(lines)
        rewards = [float(r.get("reward_mean", 0.0)) for r in applied][-SPARK_POINTS:]
        losses = [float(r.get("loss", 0.0)) for r in applied][-SPARK_POINTS:]
        reward_chart = self.query_one("#reward", AxisSparkline)
        loss_chart = self.query_one("#loss", AxisSparkline)
        reward_chart.data, loss_chart.data = rewards, losses
        self.query_one("#reward-label", Static).update(
            f"reward (mean per step, last {len(rewards)} steps) · {reward_chart.scale_text()}"
        )
        self.query_one("#loss-label", Static).update(
            f"loss (last {len(losses)} steps) · {loss_chart.scale_text()}"
        )

    def _render_buses(self, buses: dict[str, BusStatistics]) -> None:
        table = self.query_one("#tasks", DataTable)
        seen = []
        summary = Text()
        for name, stats in buses.items():
            if "error" in stats:
                summary.append(f"{name}: ", style="bold")
                summary.append(f"unavailable ({stats['error']})\n", style="red")
                continue
            for task, counts in (stats.get("tasks") or {}).items():
                key = f"{name}/{task}"
                seen.append(key)
                lag = int(counts.get("lag", 0))
                cells = {
                    "bus": name,
                    "task": task,
                    "pending": str(counts.get("pending", 0)),
                    "leased": str(counts.get("leased", 0)),
                    "acked": str(counts.get("acked", 0)),
                    "lag": Text(str(lag), style="bold yellow" if lag else ""),
                }
                if key in table.rows:
                    for column, value in cells.items():
                        table.update_cell(key, column, value, update_width=True)
                else:
                    table.add_row(*(cells[c] for c in TASK_COLUMNS), key=key)
            summary.append_text(bus_summary(name, stats))
        for key in [k.value for k in table.rows if k.value not in seen]:
            table.remove_row(key)
        summary.rstrip()
        self.query_one("#buses", Static).update(summary)

    def _trainer_version(self) -> Any:
        return ((self.snapshot or {}).get("trainer") or {}).get("version")

    # ------------------------------------------------------------------ actions

    def selected_actor(self) -> str | None:
        """The id path of the actor under the cursor (``sup/child`` for nested ones)."""
        table = self.query_one("#actors", DataTable)
        if not table.row_count:
            return None
        return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    def action_restart(self) -> None:
        actor = self.selected_actor()
        if actor is None:
            self.notify("no actor selected", severity="warning")
        elif "/" in actor:
            self.notify(
                f"{actor}: only top-level children can be restarted from here", severity="warning"
            )
        else:
            # A restart kills work in flight (a generation batch, a training step): ask first.
            def answered(yes: bool | None) -> None:
                if yes:
                    self._operate(
                        "restart", {"op": "restart", "child": actor}, f"restarted {actor}"
                    )
                else:
                    self.notify(f"{actor} not restarted")

            self.push_screen(
                Confirm(
                    f"Restart [b]{actor}[/b]? It stops (work in flight is lost or redone) and "
                    "starts again in place."
                ),
                answered,
            )

    def action_toggle_pause(self) -> None:
        if self.paused is None:
            self.notify("no status yet: is the cluster running?", severity="warning")
            return
        op = "resume" if self.paused else "pause"
        self._operate(op, {"op": op}, "generation resumed" if self.paused else "generation paused")

    def rollout_replicas(self) -> int:
        """How many rollout replicas the last status shows (0 before the first one)."""
        children = ((self.snapshot or {}).get("tree") or {}).get("children") or []
        return sum(1 for c in children if ROLLOUT_ID.match(str(c.get("id", ""))))

    def action_scale(self, delta: int) -> None:
        replicas = self.rollout_replicas()
        if not replicas:
            self.notify("no status yet: is the cluster running?", severity="warning")
            return
        wanted = replicas + delta
        if wanted < 1:  # removing the last one would stop generation: that is what p is for
            self.notify("one rollout is the fewest; p pauses generation", severity="warning")
            return
        self._operate(
            "scale",
            {"op": "scale", "role": "rollout", "replicas": wanted},
            f"rollouts: {replicas} -> {wanted}",
        )

    def action_set_staleness(self) -> None:
        if self.snapshot is None:
            self.notify("no status yet: is the cluster running?", severity="warning")
            return
        samples = (self.snapshot.get("bus") or {}).get("samples") or {}
        now = samples.get("staleness", "?")

        def answered(value: str | None) -> None:
            if value is None:
                return
            try:
                bound = Staleness.parse(int(value) if value.isdigit() else value)
            except ValueError as exc:
                self.notify(f"staleness: {exc}", severity="error", timeout=10)
                return
            payload = {"op": "set", "key": "staleness", "value": bound.wire}
            self._operate("set", payload, f"staleness: {now} -> {bound.wire}")

        self.push_screen(
            AskValue(f"Staleness bound (now {now}): 0, 1, 2, … or inf", placeholder="inf"),
            answered,
        )

    def _operate(self, name: str, payload: dict[str, Any], done: str) -> None:
        if self.op_in_flight is not None:
            self.notify(f"wait: {self.op_in_flight} is still in progress", severity="warning")
            return
        if self.connection != "connected":
            self.notify("the cluster is not reachable", severity="error")
            return
        self.op_in_flight = name
        self._show_banner()
        self.run_worker(self._request(name, payload, done), group="ops")

    async def _request(self, name: str, payload: dict[str, Any], done: str) -> None:
        try:
            reply = await control_request(self.run_dir, payload, timeout=self.op_timeout)
        except Exception as exc:  # shown to the operator, not fatal
            self.notify(f"{name} failed: {exc}", severity="error", timeout=10)
        else:
            if isinstance(reply, dict) and "paused" in reply:
                self.paused = bool(reply["paused"])
            self.notify(done)
        finally:
            self.op_in_flight = None
            self._show_banner()
            self.refresh_now()


__all__ = ["StatusApp"]
