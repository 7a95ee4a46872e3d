"""What `relax up` keeps in a run folder and finds there: ``run.json`` (how the run was
started; ``relax ckpt`` and ``relax down`` read it), the folder a new run gets, the newest run
of a cluster (for ``--resume``), the command that resumes a run, and its latest checkpoint."""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax.config import ClusterConfig

RUN_INFO = "run.json"
"""How a run was started (written by ``relax up``); ``relax ckpt``/``down`` read it."""
UP_LOG = "up.log"
"""All output of a ``relax up --detach`` cluster."""
UP_PID = "up.pid"
"""The pid of a ``relax up --detach`` cluster, from before it serves ``control.json``."""


SECRET_WORDS = ("secret", "token", "password", "api_key")
"""A ``--set`` whose key's last part contains one of these carries a secret."""
REDACTED = "<secret>"


def is_secret_override(override: str) -> bool:
    """Whether ``KEY=VALUE`` sets a secret (``cluster.secret=...``): it must never be written to
    ``run.json``, a log or a printed command."""
    last = override.partition("=")[0].strip().rsplit(".", 1)[-1].lower()
    return any(word in last for word in SECRET_WORDS)


def redacted(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with the value of every secret one replaced by ``<secret>``."""
    return [
        f"{item.partition('=')[0]}={REDACTED}" if is_secret_override(item) else item
        for item in overrides
    ]


def private_folder(path: Path) -> None:
    """Make ``path`` (and parents) with mode 0700: a run folder holds data, logs and endpoint
    files that only its owner should read."""
    Path(path).mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (also when the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The run's ``run.json`` (empty when ``relax up`` did not write one, or it is unreadable)."""
    try:
        data = json.loads((Path(run_dir) / RUN_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _absolute(path: str | Path, base: Path | None = None) -> str:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (base or Path.cwd()) / p
    return str(p.resolve())


def write_run_info(
    run_dir: Path, cfg: ClusterConfig, cluster_toml: Path, overrides: Sequence[str]
) -> None:
    """Record how the run was started (the latest start, for a resumed run)."""
    tokenizer = cfg.model.effective_tokenizer
    info = {
        "cluster": cfg.cluster.name,
        "cluster_toml": _absolute(cluster_toml),
        "overrides": redacted(overrides),  # never a secret in a file
        "steps": cfg.trainer.steps,
        "run_dir": _absolute(run_dir),
        "checkpoint_dir": _absolute(Path(run_dir) / cfg.checkpoint.dir),
        "model_dir": _absolute(Path(run_dir) / "model")
        if cfg.model.init is not None
        else _absolute(cfg.model.path or ""),
        "tokenizer": tokenizer if tokenizer == "byte" else _absolute(tokenizer),
        "pid": os.getpid(),
        "started_at": time.time(),
    }
    private_folder(Path(run_dir))
    write_private(Path(run_dir) / RUN_INFO, json.dumps(info, indent=2) + "\n")


def default_run_dir(cfg: ClusterConfig) -> Path:
    """``cluster.run_dir/NAME-YYYYmmdd-HHMMSS`` (what the cluster picks itself), made unique."""
    base = Path(cfg.cluster.run_dir) / f"{cfg.cluster.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def newest_run_of(runs: Path, name: str) -> Path | None:
    """The latest-named ``NAME-*`` folder under ``runs``, whatever it holds.

    Not ``relax.cli._runs.newest_run``: that one wants a folder a cluster wrote into and goes
    by modification time; ``--resume`` goes by the timestamp in the name, and must also find a
    run that stopped before writing anything but ``run.json``.
    """
    found = sorted(p for p in runs.glob(f"{name}-*") if p.is_dir()) if runs.exists() else []
    return found[-1] if found else None


def set_flags(overrides: Sequence[str]) -> list[str]:
    """``--set KEY=VALUE`` for each override, as ``relax up`` takes them again."""
    return [arg for item in overrides for arg in ("--set", item)]


def resume_hint(
    cluster_toml: Path, overrides: Sequence[str], run_dir: Path, cfg: ClusterConfig
) -> str:
    """The command that continues this run (``--run-dir`` only when ``--resume`` alone would
    pick another folder); a secret ``--set`` shows as ``<secret>``, to be given again."""
    argv = ["relax", "up", str(cluster_toml), "--resume"]
    newest = newest_run_of(Path(cfg.cluster.run_dir), cfg.cluster.name)
    if newest is None or newest.resolve() != Path(run_dir).resolve():
        argv += ["--run-dir", str(run_dir)]
    return shlex.join(argv + set_flags(redacted(overrides)))


def latest_checkpoint(run_dir: Path, cfg: ClusterConfig) -> Path | None:
    """The run's newest ``step-N`` checkpoint folder (names are zero-padded: they sort)."""
    folder = Path(run_dir) / cfg.checkpoint.dir
    found = sorted(folder.glob("step-*")) if folder.is_dir() else []
    return found[-1] if found else None
