"""Plots of a run: PNG charts drawn from its ``metrics.jsonl`` (``relax plot``, and ``relax up``
at the end of every run).

::

    from relax.plot import write_plots
    write_plots("runs/quickstart-20250101-120000")   # -> runs/.../plots/*.png

One chart per quantity, written only when the metrics hold it:

- ``reward.png``      mean reward per step (with a moving average);
- ``loss.png``        total loss, and its parts (policy, KL, entropy, value) when logged;
- ``kl.png``          KL to the reference (``kl``) and the policy's own ``approx_kl``;
- ``entropy.png``     mean token entropy;
- ``staleness.png``   histogram of staleness = trainer version at take - oldest row version
                      (how many versions behind the oldest sample of each step was);
- ``step_time.png``   wall-clock seconds per step, and per phase (every ``*_time_s`` field);
- ``critic.png``      the critic's losses from ``critic.jsonl`` (runs with a ``[critic]``);
- ``eval.png``        mean reward, pass@1 and pass@k of each evaluation, from ``eval.jsonl``
                      (runs with ``[eval] every_steps`` > 0).

matplotlib is an optional dependency (the ``plot`` extra: ``pip install 'relax-rl[plot]'``);
it is imported lazily, with the non-interactive Agg backend, so nothing here needs a display.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax.errors import PlotError

PLOTS_DIR = "plots"
"""Folder of a run where ``relax up`` and ``relax plot`` write the charts by default."""

EVAL_FILE = "eval.jsonl"
"""The evaluator's records in a run folder (``relax.observe.EVAL_FILE``; plot is a floor below)."""
EVAL_KEYS = ("eval/mean_reward", "eval/pass@1", "eval/pass@k")
"""What ``eval.png`` draws, per evaluated version."""

INSTALL_HINT = "pip install 'relax-rl[plot]'  (or: pip install matplotlib)"


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules (tests) raises ValueError
        return False


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            f"plotting needs matplotlib, which is not installed; install the plot extra: {INSTALL_HINT}"
        ) from None
    matplotlib.use("Agg", force=True)  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def read_records(path: Path) -> list[dict[str, Any]]:
    """JSON objects of a JSON Lines file; a torn or foreign line is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` over the records that have a finite number for it."""
    xs, ys = [], []
    for i, record in enumerate(records):
        value = _number(record.get(key))
        if value is not None:
            step = _number(record.get("step"))
            xs.append(step if step is not None else float(i + 1))
            ys.append(value)
    return xs, ys


def staleness(record: dict[str, Any]) -> int | None:
    """Versions between the trainer when it took a batch and the batch's oldest row."""
    take = _number(record.get("trainer_version_at_take"))
    oldest = _number(record.get("oldest_row_version"))
    return None if take is None or oldest is None else int(take - oldest)


def phase_keys(records: Sequence[dict[str, Any]]) -> list[str]:
    """The per-phase timing fields the records carry (``*_time_s``), in first-seen order."""
    keys: list[str] = []
    for record in records:
        for key, value in record.items():
            if key.endswith("_time_s") and key not in keys and _number(value) is not None:
                keys.append(key)
    return keys


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_plots(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    title: str | None = None,
    compare: Sequence[str | Path] = (),
) -> list[Path]:
    """Draw every chart the run's metrics allow into ``out_dir`` (default ``RUN_DIR/plots``).

    ``compare``: other runs (or replays: ``relax replay --set``) whose lines are drawn dashed
    on the same line charts, named by their folder.

    Returns the PNG files written. Raises ``PlotError`` when matplotlib is missing (naming the
    ``plot`` extra) or when a run has no ``metrics.jsonl`` records yet.
    """
    run = Path(run_dir)
    records = read_records(run / "metrics.jsonl")
    if not records:
        raise PlotError(f"{run} has no metrics yet (no records in {run / 'metrics.jsonl'})")
    others = []
    for other in map(Path, compare):
        theirs = read_records(other / "metrics.jsonl")
        if not theirs:
            raise PlotError(f"{other} has no metrics (no records in {other / 'metrics.jsonl'})")
        others.append((other.name, [r for r in theirs if r.get("applied", True)] or theirs))
    plt = _pyplot()
    out = Path(out_dir) if out_dir is not None else run / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    name = title or run.name
    applied = [r for r in records if r.get("applied", True)] or records
    written: list[Path] = []

    def save(fig: Any, filename: str) -> None:
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def lines(filename: str, heading: str, ylabel: str, keys: Sequence[str], smooth: bool = False):
        drawn = [(key, *series(applied, key)) for key in keys]
        drawn = [(key, xs, ys) for key, xs, ys in drawn if ys]
        if not drawn:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, xs, ys in drawn:
            ax.plot(xs, ys, label=key, alpha=0.45 if smooth and len(ys) > 4 else 1.0)
            if smooth and len(ys) > 4:
                window = max(2, len(ys) // 10)
                ax.plot(xs, _moving_average(ys, window), label=f"{key} (mean of {window})")
        for other, theirs in others:
            for key, _, _ in drawn:
                xs, ys = series(theirs, key)
                if ys:
                    ax.plot(xs, ys, linestyle="--", label=f"{key} · {other}")
        ax.set_title(f"{heading} · {name}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(drawn) > 1 or smooth or others:
            ax.legend()
        save(fig, filename)

    lines("reward.png", "Reward", "mean reward", ["reward_mean"], smooth=True)
    lines(
        "loss.png",
        "Loss",
        "loss",
        ["loss", "policy_loss", "kl_loss", "entropy_loss", "value_loss"],
    )
    lines("kl.png", "KL divergence", "KL", ["kl", "approx_kl"])
    lines("grad_norm.png", "Gradient norm", "global norm before clipping", ["grad_norm"])
    lines("entropy.png", "Entropy", "mean token entropy (nats)", ["entropy"])

    lags = [s for s in (staleness(r) for r in records) if s is not None]
    if lags:
        fig, ax = plt.subplots(figsize=(7, 4))
        low, high = min(lags), max(lags)
        ax.hist(lags, bins=[b - 0.5 for b in range(low, high + 2)], rwidth=0.8)
        ax.set_xticks(range(low, high + 1))
        ax.set_title(f"Staleness · {name}")
        ax.set_xlabel("versions behind (trainer version at take - oldest row version)")
        ax.set_ylabel("steps")
        ax.grid(alpha=0.3, axis="y")
        save(fig, "staleness.png")

    phases = phase_keys(records)
    xs, wall = series(records, "wall_s")
    if wall or phases:
        fig, ax = plt.subplots(figsize=(7, 4))
        if wall:
            ax.plot(xs, wall, label="wall_s (the whole step)", color="black")
        for key in phases:
            ax.plot(*series(records, key), label=key)
        ax.set_title(f"Step time · {name}")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "step_time.png")

    critic = read_records(run / "critic.jsonl")
    keys = [k for k in ("value_loss", "loss") if any(_number(r.get(k)) is not None for r in critic)]
    if keys:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            ys = [v for v in (_number(r.get(key)) for r in critic) if v is not None]
            ax.plot(range(1, len(ys) + 1), ys, label=key)
        ax.set_title(f"Critic · {name}")
        ax.set_xlabel("critic update")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "critic.png")

    evals = read_records(run / EVAL_FILE)
    drawn = [(key, *series(evals, key)) for key in EVAL_KEYS]
    drawn = [(key, xs, ys) for key, xs, ys in drawn if ys]
    if drawn:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, xs, ys in drawn:
            ax.plot(xs, ys, marker="o", label=key)
        ax.set_title(f"Evaluation (held-out prompts) · {name}")
        ax.set_xlabel("policy version (trainer step)")
        ax.set_ylabel("reward / pass rate")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "eval.png")
    return written


__all__ = [
    "EVAL_FILE",
    "EVAL_KEYS",
    "INSTALL_HINT",
    "PLOTS_DIR",
    "PlotError",
    "matplotlib_available",
    "phase_keys",
    "read_records",
    "series",
    "staleness",
    "write_plots",
]
