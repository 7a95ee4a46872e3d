"""``relax replay``: re-execute a run's trainer from its record, bit for bit.

The record (``relax.replay._record``) is the lineage of the run's weights: every start of a
trainer (fresh, or from a checkpoint, or continuing from published weights), every step's
rows, every checkpoint. A replay walks it in order with the same code the trainer runs:

- a **start** builds the backend as a trainer does (``build_backend``: seeded by
  ``trainer.seed``, the policy from the model folder), loads the checkpoint the original
  loaded — the replay's own copy, saved where the original saved it — and adopts the weights
  the original adopted (which are the replay's own weights of that version);
- a **step** trains on the recorded rows, then compares ``applied``, every metric (timings
  aside) and the digest of the new weights with the record, bit for bit;
- a **checkpoint** is saved where a later start loads it.

So a trainer SIGKILLed mid-run replays as it happened: the optimiser state it lost, the
checkpoint it went back to, the weights it continued from. With ``overrides`` (``--set``) the
replay is a counterfactual: the same recorded data trained another way; nothing is compared.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relax.config import ClusterConfig, override_path, validate_config
from relax.replay._generations import RegenerateReport, Regenerator
from relax.replay._record import (
    RECORD_DIR,
    Record,
    RecordError,
    comparable_metrics,
    weights_digest,
)

REPLAYS_DIR = "replays"
"""Where a run's replays go by default: ``RUN_DIR/replays/replay-N``."""

CHANGEABLE = ("trainer", "algorithm")
"""Sections a counterfactual replay may change: how the recorded data is trained."""


@dataclass(frozen=True)
class Divergence:
    """Where a replay first differed from the record."""

    event: int
    """Index of the record's event (its line in ``events.jsonl``, from 0)."""
    step: int
    what: str
    recorded: Any
    replayed: Any

    def __str__(self) -> str:
        return (
            f"step {self.step} (event {self.event}): {self.what} "
            f"recorded {self.recorded!r}, replayed {self.replayed!r}"
        )


@dataclass
class ReplayReport:
    out_dir: Path
    counterfactual: bool
    steps: int = 0
    """Steps replayed (applied and skipped)."""
    applied: int = 0
    restarts: int = 0
    """Trainer restarts replayed (starts after the first)."""
    compared: int = 0
    """Values compared bit for bit with the record (metrics, digests, applied flags)."""
    divergences: list[Divergence] = field(default_factory=list)
    regenerated: RegenerateReport | None = None
    """With ``regenerate``: the trained rows generated again and compared."""
    wall_s: float = 0.0

    @property
    def identical(self) -> bool:
        return not self.counterfactual and not self.divergences


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _config(config: dict[str, Any], overrides: Sequence[str]) -> ClusterConfig:
    for override in overrides:
        path = override_path(override.partition("=")[0].strip())
        if path is None or path[0] not in CHANGEABLE:
            raise RecordError(
                f"--set {override!r}: a replay trains the recorded data again, so it can change "
                f"only how it is trained ({', '.join(s + '.*' for s in CHANGEABLE)})"
            )
    cfg = validate_config(config, source="the run's record", overrides=overrides)
    if cfg.trainer.gang > 1:
        raise RecordError(
            f"the run trained with a gang of {cfg.trainer.gang} ranks; a replay runs one "
            "process, whose sums would not match the gang's bit for bit"
        )
    return cfg


def _next_folder(parent: Path) -> Path:
    n = 1
    while (parent / f"replay-{n}").exists():
        n += 1
    return parent / f"replay-{n}"


def replay(
    run_dir: str | Path,
    *,
    until: int | None = None,
    overrides: Sequence[str] = (),
    out_dir: str | Path | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    regenerate: bool = False,
) -> ReplayReport:
    """Replay the trainer of the run in ``run_dir`` up to version ``until`` (default: all of
    its record); write the replay's ``metrics.jsonl`` and ``replay.json`` to ``out_dir``
    (default ``RUN_DIR/replays/replay-N``). ``on_step`` sees each replayed step's record.
    With ``regenerate``, every trained row is also generated again, on the replay's weights
    of the versions it was generated with, and compared (``relax.replay._generations``)."""
    import torch

    from relax.training import build_backend, checkpoint_name  # torch: only when replaying

    run_dir = Path(run_dir)
    started = time.monotonic()
    record = Record.read(run_dir)
    cfg = _config(record.config, overrides)  # checked before anything starts
    if regenerate and overrides:
        raise RecordError(
            "--regenerate checks the recorded generations on the recorded weights; "
            "a counterfactual (--set) trains other weights"
        )
    regen = None
    if regenerate:  # every trained uid first: which versions to hold, and until when
        steps = [e for e in record.events if e["event"] == "step"]
        trained = [
            row["uid"]
            for e in steps
            if until is None or e["step"] <= until
            for row in record.rows(e["batch"])
        ]
        regen = Regenerator(run_dir / RECORD_DIR, cfg, record.model_dir, trained)
    out = Path(out_dir) if out_dir is not None else _next_folder(run_dir / REPLAYS_DIR)
    out.mkdir(parents=True, exist_ok=False)
    report = ReplayReport(out, counterfactual=bool(overrides))
    # Checkpoints a later start loads: the replay saves its own where the original saved them.
    needed = {e["checkpoint"] for e in record.events if e["event"] == "start"} - {None}
    originals = run_dir / cfg.checkpoint.dir

    def checkpoint_of(version: int) -> Path:
        for folder in (out / "checkpoints", originals):  # ours; else the run's own (a resume)
            path = folder / checkpoint_name(version)
            if path.exists():
                return path
        raise RecordError(f"the record starts from the checkpoint of step {version}; it is gone")

    def compare(index: int, step: int, what: str, recorded: Any, replayed: Any) -> None:
        if report.counterfactual or recorded is None:
            return
        report.compared += 1
        if not _equal(recorded, replayed):
            report.divergences.append(Divergence(index, step, what, recorded, replayed))

    backend: Any = None
    with contextlib.ExitStack() as stack:
        metrics_file = stack.enter_context(open(out / "metrics.jsonl", "w"))
        if regen is not None:
            stack.callback(regen.close)
        for index, event in enumerate(record.events):
            kind = event["event"]
            if kind == "start":
                torch.set_num_threads(event["threads"])  # the sums' split, as the original's
                held = None
                if event["adopted"] is not None:
                    if backend is None or backend.version != event["adopted"]:
                        raise RecordError(
                            f"event {index}: the trainer continued from published version "
                            f"{event['adopted']}, which the record does not produce"
                        )
                    held = backend.state_dict_for_publish()
                report.restarts += backend is not None
                # A resumed run may have changed its config (`relax up --resume --set ...`).
                cfg = _config(event.get("config", record.config), overrides)
                backend = build_backend(cfg, record.model_dir)
                if event["checkpoint"] is not None:
                    backend.load_checkpoint(checkpoint_of(event["checkpoint"]))
                if held is not None:
                    backend.adopt(event["adopted"], held)
                compare(
                    index, backend.version, "version at start", event["version"], backend.version
                )
                if not report.counterfactual:
                    state = backend.state_dict_for_publish()
                    compare(
                        index,
                        backend.version,
                        "weights at start",
                        event["weights"],
                        weights_digest(state),
                    )
                    if regen is not None:
                        regen.produced(backend.version, state)
            elif kind == "checkpoint":
                if event["step"] in needed:
                    backend.save_checkpoint(out / "checkpoints" / checkpoint_name(event["step"]))
            elif kind == "step":
                if until is not None and event["step"] > until:
                    break
                rows = record.rows(event["batch"])
                if regen is not None:  # generated with the versions held now
                    for uid, (what, recorded, regenerated) in regen.check(rows):
                        report.divergences.append(
                            Divergence(index, event["step"], f"{uid} {what}", recorded, regenerated)
                        )
                result = backend.step(rows)
                step = backend.version
                report.steps += 1
                report.applied += result.applied
                compare(index, step, "applied", event["applied"], result.applied)
                replayed = comparable_metrics(result.metrics)
                for name, value in event["metrics"].items():
                    compare(index, step, name, value, replayed.get(name))
                if result.applied and not report.counterfactual:
                    state = backend.state_dict_for_publish()
                    compare(index, step, "weights", event["weights"], weights_digest(state))
                    if regen is not None:
                        regen.produced(step, state)
                line = {"step": step, "applied": result.applied, **result.metrics}
                line["time"] = time.time()
                metrics_file.write(json.dumps(line) + "\n")
                if on_step is not None:
                    on_step(line)
    report.regenerated = regen.report if regen is not None else None
    report.wall_s = time.monotonic() - started
    summary = {
        "run_dir": str(run_dir),
        "overrides": list(overrides),
        "until": until,
        "steps": report.steps,
        "applied": report.applied,
        "restarts": report.restarts,
        "compared": report.compared,
        "identical": report.identical,
        "first_divergence": str(report.divergences[0]) if report.divergences else None,
        "regenerated": asdict(regen.report) if regen is not None else None,
        "wall_s": report.wall_s,
    }
    (out / "replay.json").write_text(json.dumps(summary, indent=2) + "\n")
    return report
