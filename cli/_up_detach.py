"""`relax up --detach`: start ``relax up`` again as a background process in a session of its
own (so neither a Ctrl-C here nor a closed shell reaches it), its output in ``RUN_DIR/up.log``
and its pid in ``RUN_DIR/up.pid``, and return once its control endpoint is up."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from relax.cli._up_run_folder import UP_LOG, UP_PID, set_flags

if TYPE_CHECKING:
    from relax.config import ClusterConfig


def launch_detached(
    cfg: ClusterConfig,
    *,
    cluster_toml: Path,
    overrides: Sequence[str],
    run_dir: Path,
    resume: bool,
    start_timeout: float,
) -> int:
    """Start ``relax up`` again in a new session, output to ``RUN_DIR/up.log``; return once
    its control endpoint is up (``control.json`` naming it) or it died."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "relax.cli", "up", str(cluster_toml), "--run-dir", str(run_dir)]
    argv.append("--no-progress")
    if resume:
        argv.append("--resume")
    argv += set_flags(overrides)
    log_path = run_dir / UP_LOG
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("ab") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n".encode())
        log.flush()
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # no terminal: Ctrl-C here or a closed shell leave it be
            env=env,
        )
    (run_dir / UP_PID).write_text(f"{child.pid}\n")
    deadline = time.monotonic() + start_timeout
    while True:
        code = child.poll()
        if code is not None:
            typer.echo(
                f"the cluster exited (status {code}) before it was up; {log_path} ends:", err=True
            )
            for line in _tail(log_path, 25):
                typer.echo(f"  {line}", err=True)
            return 1
        if _serving(run_dir, child.pid):
            break
        if time.monotonic() > deadline:
            typer.echo(
                f"the cluster (pid {child.pid}) is still starting after {start_timeout:g} s; "
                f"watch {log_path}",
                err=True,
            )
            break
        time.sleep(0.1)
    typer.echo(f'started cluster "{cfg.cluster.name}" in the background (pid {child.pid})')
    typer.echo(f"  run folder  {run_dir}")
    typer.echo(f"  output      {log_path}")
    typer.echo(f"  watch       relax status --run-dir {run_dir}")
    typer.echo(f"  logs        relax logs -f --run-dir {run_dir}")
    typer.echo(f"  stop        relax down --run-dir {run_dir}")
    return 0


def _serving(run_dir: Path, pid: int) -> bool:
    """Whether the run's ``control.json`` names ``pid``: the cluster serves its endpoint (it
    writes the file once listening)."""
    from relax.cli._down import _read_control

    info = _read_control(run_dir)
    return info is not None and info["pid"] == pid


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []
