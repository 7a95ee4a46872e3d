"""`relax down`: stop a running cluster cleanly, and make sure none of its processes is left.

1. Record every process of the run: the cluster's pid and each actor's pids from a status
   snapshot (with their start times, so a recycled pid is never mistaken for one of ours).
2. Send the control endpoint's ``stop``: the tree stops in reverse start order and the trainer
   saves a final checkpoint. Wait up to ``--timeout`` seconds for the cluster to exit.
3. Past the timeout: SIGTERM, then SIGKILL — to the cluster's process group when it leads one
   (``relax up --detach`` does), else to the cluster's pid. A cluster whose control endpoint
   does not answer gets the SIGTERM at once (``relax up`` stops the tree on SIGTERM too).
4. Check every recorded pid is gone (killing any straggler) and say so.
5. A run on Ray: check no Ray actor or placement group of it is left on its cluster (removing
   any that Ray did not clean up after the cluster's process), and say so.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from relax.cli._app import app
from relax.cli._ckpt import list_checkpoints
from relax.cli._runs import (
    DEFAULT_RUNS,
    RunDirOption,
    cluster_running,
    is_run_dir,
    resolve_run_dir,
)
from relax.cli._up_run_folder import UP_PID, read_run_info
from relax.runfiles import CONTROL_FILE, RAY_FILE, read_control, read_ray_info

GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL."""


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), or None if it is not running.

    A zombie counts as not running: it no longer runs code, and only its parent can reap it.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0
        return 0
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of stat: starttime


def alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs (and, given its recorded start time, is still that process)."""
    now = process_start(pid)
    return now is not None and (started is None or now == 0 or now == started)


def snapshot_pids(tree: dict[str, Any]) -> set[int]:
    """Every pid a supervisor snapshot names: the tree's own and every child's, nested —
    except Ray children's, whose pids are on their own nodes (the Ray check covers them)."""
    pids = {int(tree["pid"])} if isinstance(tree.get("pid"), int) else set()
    for child in tree.get("children") or []:
        if child.get("placement") != "ray":
            pids.update(int(p) for p in child.get("pids") or [])
        pids |= snapshot_pids({"children": child.get("children") or []})
    return pids


def descendants(pid: int) -> set[int]:
    """Every running process below ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _wait_gone(pids: dict[int, int | None], timeout: float) -> dict[int, int | None]:
    """Poll until none of ``pids`` runs or ``timeout`` passes; returns those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = {pid: start for pid, start in pids.items() if alive(pid, start)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _signal(pid: int, sig: signal.Signals, *, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid and pid != os.getpgrp()
    except ProcessLookupError:
        return False


def _force(pid: int, started: int | None, what: str, grace: float | None = None) -> None:
    """SIGTERM, a grace period, then SIGKILL (to the group ``pid`` leads, if it leads one)."""
    grace = GRACE_S if grace is None else grace
    group = _leads_group(pid)
    target = f"process group {pid}" if group else f"pid {pid}"
    typer.echo(f"{what}; sending SIGTERM to {target}", err=True)
    _signal(pid, signal.SIGTERM, group=group)
    if _wait_gone({pid: started}, grace):
        typer.echo(f"still running after {grace:g} s; sending SIGKILL to {target}", err=True)
        _signal(pid, signal.SIGKILL, group=group)
        _wait_gone({pid: started}, GRACE_S)


def resume_command(run: Path) -> str:
    info = read_run_info(run)
    argv = ["relax", "up", info.get("cluster_toml") or "CLUSTER_TOML", "--resume", "--run-dir"]
    argv.append(str(run))
    for item in info.get("overrides") or []:
        argv += ["--set", item]
    return shlex.join(argv)


def _checkpoint_line(run: Path) -> str | None:
    found = list_checkpoints(run)
    return f"latest checkpoint: step {found[-1].step} ({found[-1].path})" if found else None


def _starting_pid(run: Path) -> int | None:
    """The pid of a ``relax up --detach`` child that has not served its control endpoint yet."""
    try:
        pid = int((run / UP_PID).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"relax" not in f.read():
                return None  # a recycled pid: not ours
    except OSError:
        return None
    return pid if alive(pid) else None


def _running_run() -> Path | None:
    """Without --run-dir: the one run under ./runs whose cluster is alive (None: let
    ``resolve_run_dir`` pick the newest run); several running ones must be chosen from."""
    runs = DEFAULT_RUNS
    found = sorted(p for p in runs.glob("*") if is_run_dir(p) and cluster_running(p))
    if len(found) > 1:
        typer.echo(f"{len(found)} clusters are running; pick one with --run-dir:", err=True)
        for path in found:
            typer.echo(f"  relax down --run-dir {path}", err=True)
        raise typer.Exit(2)
    return found[0] if found else None


def _request(run: Path, payload: dict[str, Any], timeout: float) -> Any:
    from relax.control import connect_control

    async def request() -> Any:
        client = await connect_control(run, timeout=3.0)
        try:
            return await client.request(payload, timeout=timeout)
        finally:
            await client.aclose()

    return asyncio.run(request())


@app.command("down")
def down(
    run_dir: RunDirOption = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds to wait for a clean stop before SIGTERM, then SIGKILL "
            f"({GRACE_S:g} s later).",
        ),
    ] = 60.0,
) -> None:
    """Stop the run's cluster cleanly and check that no process of it is left.

    The tree stops in reverse start order and the trainer saves a final checkpoint; past
    --timeout the cluster is terminated (SIGTERM), then killed (SIGKILL). Every process the
    run had (from a status snapshot) is checked to be gone.
    """
    from relax.errors import RelaxError

    run = run_dir if run_dir is not None else _running_run()
    run = resolve_run_dir(run)
    info = read_control(run)
    if info is None or not alive(info.pid):
        starting = _starting_pid(run) if info is None else None
        if starting is not None:
            _force(starting, process_start(starting), f"the cluster of {run} is still starting")
            left = _wait_gone({starting: None}, 1.0)
            if left:
                typer.echo(f"pid {starting} is still running", err=True)
                raise typer.Exit(1)
            typer.echo(f"stopped the cluster of {run} while it was starting (pid {starting})")
            return
        why = (
            f"no {CONTROL_FILE}"
            if info is None
            else f"its {CONTROL_FILE} names pid {info.pid}, which is gone"
        )
        typer.echo(f"nothing to stop: no cluster is running in {run} ({why})")
        _check_ray(run, strict=False)
        line = _checkpoint_line(run)
        if line:
            typer.echo(line)
            typer.echo(f"resume with: {resume_command(run)}")
        return

    pid = info.pid
    name = info.cluster or run.name
    pids = {pid}
    answers = True
    try:
        snapshot = _request(run, {"op": "status", "history": 1}, timeout=15)
        pids |= snapshot_pids(snapshot.get("tree") or {})
    except (RelaxError, OSError, TimeoutError) as exc:
        answers = False
        typer.echo(f"warning: the cluster does not answer ({exc})", err=True)
    pids |= descendants(pid)  # children the snapshot does not list yet (still starting)
    recorded = {p: process_start(p) for p in sorted(pids)}
    count = len(pids)
    what = f'"{name}" (pid {pid}, {count} process{"es" if count != 1 else ""}) in {run}'
    started = time.monotonic()
    if answers:
        typer.echo(
            f"stopping {what}: the tree stops in reverse start order, the trainer saves a "
            "checkpoint"
        )
        try:
            _request(run, {"op": "stop"}, timeout=15)
        except (RelaxError, OSError, TimeoutError) as exc:
            typer.echo(f"warning: the stop request failed ({exc})", err=True)
        if _wait_gone({pid: recorded[pid]}, timeout):
            _force(pid, recorded[pid], f"the cluster did not stop within {timeout:g} s")
    else:  # `relax up` stops the tree on SIGTERM too, if its event loop still runs
        typer.echo(f"terminating {what}")
        _force(pid, recorded[pid], "no stop request possible", grace=max(timeout, GRACE_S))
    # Children end with the cluster (they die with their parent); give them a moment.
    left = _wait_gone(recorded, 5.0)
    for straggler, start in left.items():
        typer.echo(f"pid {straggler} outlived the cluster; sending SIGKILL", err=True)
        if alive(straggler, start):
            _signal(straggler, signal.SIGKILL, group=False)
    left = _wait_gone(left, 5.0)
    elapsed = time.monotonic() - started
    if not alive(pid) and (run / CONTROL_FILE).exists():
        (run / CONTROL_FILE).unlink(missing_ok=True)  # stale: the cluster was killed
    if left:
        typer.echo(
            f"processes of the run are still running after {elapsed:.1f} s: "
            f"{_pid_list(left)}; stop them by hand (kill -9 PID)",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(
        f"stopped in {elapsed:.1f} s; no process of the run is left (checked {_pid_list(recorded)})"
    )
    _check_ray(run)
    line = _checkpoint_line(run)
    if line:
        typer.echo(line)
    typer.echo(f"resume with: {resume_command(run)}")


def _check_ray(run: Path, *, strict: bool = True) -> None:
    """Step 5: what of the run is left on its Ray cluster (removed, or named and exit 1);
    a cluster that does not answer fails the check when ``strict``, else it is a warning."""
    info = read_ray_info(run)
    if info is None:
        if (run / RAY_FILE).exists():
            typer.echo(f"warning: {run / RAY_FILE} is unreadable; Ray not checked", err=True)
        return
    from relax.actors import ray_connection, ray_sweep, reachable

    if not reachable(info.gcs_address):
        if info.local:
            typer.echo("the run's private Ray instance has stopped with it")
            return
        typer.echo(
            f"the Ray cluster at {info.gcs_address} does not answer: cannot check that no Ray "
            f"actor of the run is left (namespace {info.namespace}); check with `ray list "
            "actors` once it is back",
            err=True,
        )
        if strict:
            raise typer.Exit(1)
        return
    with ray_connection(info.gcs_address, info.namespace):
        removed, left = ray_sweep(info.namespace)
    if removed:
        typer.echo(f"removed what Ray had not cleaned up: {removed.describe()}", err=True)
    if left:
        typer.echo(f"still on Ray ({info.gcs_address}): {left.describe()}", err=True)
        raise typer.Exit(1)
    typer.echo(
        f"no Ray actor or placement group of the run is left (namespace {info.namespace} on "
        f"{info.gcs_address})"
    )


def _pid_list(pids: Iterable[int]) -> str:
    items = sorted(pids)
    return ("pid " if len(items) == 1 else "pids ") + ", ".join(str(p) for p in items)
