"""`relax up --detach`: start ``relax up`` again as a background process in a session of its
own (so neither a Ctrl-C here nor a closed shell reaches it), its output in ``RUN_DIR/up.log``
and its pid in ``RUN_DIR/up.pid``, and return once its control endpoint is up."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from relax.cli._up_run_folder import (
    UP_LOG,
    UP_PID,
    is_secret_override,
    private_folder,
    redacted,
    set_flags,
    write_private,
)

ENV_SECRET_OVERRIDES = "RELAX_UP_SECRET_OVERRIDES"
"""Secret ``--set`` overrides reach the background ``relax up`` here (JSON), never in its
command line (which ``ps`` shows everyone) or in ``up.log``."""

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
    private_folder(run_dir)
    argv = [sys.executable, "-m", "relax.cli", "up", str(cluster_toml), "--run-dir", str(run_dir)]
    argv.append("--no-progress")
    if resume:
        argv.append("--resume")
    argv += set_flags([o for o in overrides if not is_secret_override(o)])
    log_path = run_dir / UP_LOG
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    secret = [o for o in overrides if is_secret_override(o)]
    if secret:
        env[ENV_SECRET_OVERRIDES] = json.dumps(secret)
    shown = shlex.join(argv + set_flags(redacted(secret)))
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "ab") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shown}\n".encode())
        log.flush()
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # no terminal: Ctrl-C here or a closed shell leave it be
            env=env,
        )
    write_private(run_dir / UP_PID, f"{child.pid}\n")
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
    from relax.runfiles import read_control

    info = read_control(run_dir)
    return info is not None and info.pid == pid


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []
