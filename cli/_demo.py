"""`relax demo`: run a demo of the supervisor tree (the actor runtime alone, no RL roles; the
main job is `relax up CLUSTER_TOML`, see the README)."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.tree import Tree

from relax.cli._app import app


def render_tree(snapshot: dict[str, Any]) -> Tree:
    """The supervisor snapshot as a rich tree (``relax status`` grows from this)."""
    root = Tree(
        f"[bold]{snapshot['id']}[/] supervisor · {snapshot['strategy']} · pid {snapshot['pid']}"
    )
    _add_children(root, snapshot.get("children", []))
    return root


def _add_children(node: Tree, children: list[dict[str, Any]]) -> None:
    for child in children:
        pids = ",".join(str(p) for p in child["pids"]) or "-"
        line = (
            f"[bold]{child['id']}[/] {child['kind']} · {child['placement']} · {child['state']}"
            f" · pid {pids} · restarts {child['restart_count']}"
        )
        crash = child.get("last_crash")
        if crash:
            line += f" · last crash: [red]{crash['description']}[/]"
        branch = node.add(line)
        _add_children(branch, child.get("children", []))


@app.command("demo")
def demo(
    jobs: int = typer.Option(200, min=2, help="Jobs the driver sends to the two workers."),
) -> None:
    """Run a demo supervisor tree: two process workers, one is SIGKILLed half-way and restarted."""
    from relax.demo import main as run_demo
    from relax.log import configure_logging

    configure_logging(level="warning")
    console = Console()
    report = run_demo(jobs)
    if report.tree is not None:
        console.print(render_tree(report.tree))
    exactly_once = sorted(report.answered) == list(range(jobs))
    correct = all(v == float(job) ** 2 for job, v in report.answered.items())
    console.print(
        f"jobs answered: {len(report.answered)}/{jobs} (exactly once: {exactly_once}, "
        f"correct: {correct}); retried after ActorDead: {report.retried}; "
        f"worker pid {report.killed_pid} SIGKILLed and answering again after "
        f"{(report.restart_seconds or 0) * 1000:.0f} ms"
    )
    if not (exactly_once and correct and report.killed_pid):
        raise typer.Exit(1)
