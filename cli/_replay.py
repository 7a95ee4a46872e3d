"""`relax replay`: re-execute a run's trainer from its record, bit for bit (or another way)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from relax.cli._app import app
from relax.cli._runs import RunDirArgument, resolve_run_dir


@app.command("replay")
def replay(
    run_dir: RunDirArgument = None,
    until: Annotated[
        int | None, typer.Option("--until", metavar="STEP", help="Stop at this version.")
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="Train the recorded data another way (trainer.* and algorithm.* keys), "
            "e.g. --set trainer.lr=3e-5: a counterfactual, compared with nothing.",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="The replay's folder (default: RUN_DIR/replays/replay-N)."
        ),
    ] = None,
    regenerate: Annotated[
        bool,
        typer.Option(
            "--regenerate",
            help="Also generate every trained row again (same seed, batch and weights "
            "versions, switching where the rollout did) and compare its tokens and "
            "logprobs with the record: a determinism check of the generation path.",
        ),
    ] = False,
) -> None:
    """Re-execute the trainer of a finished, stopped or crashed run from its own record.

    The same batches in the same order on the same initial weights, with every trainer
    restart as it happened; each step's loss, gradient norm, other metrics and weights are
    compared bit for bit with the record. Exits 1 at a divergence, naming the first.
    Writes the replay's metrics.jsonl (for `relax plot`) and replay.json to its folder.
    """
    from relax.cli._up_foreground import quiet_transformers
    from relax.errors import ConfigError
    from relax.replay import RecordError
    from relax.replay import replay as run_replay

    run = resolve_run_dir(run_dir)
    quiet_transformers()  # a replay builds the policy at every trainer start it replays

    def progress(line: dict) -> None:
        if line["step"] % 10 == 0 and line["applied"]:
            typer.echo(f"step {line['step']}: loss {line.get('loss', float('nan')):.6g}")

    try:
        report = run_replay(
            run,
            until=until,
            overrides=overrides or (),
            out_dir=out,
            on_step=progress,
            regenerate=regenerate,
        )
    except (RecordError, ConfigError) as exc:
        typer.echo(f"cannot replay {run}: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"replayed {report.steps} steps ({report.applied} applied, {report.restarts} restarts) "
        f"in {report.wall_s:.1f} s into {report.out_dir}"
    )
    regen = report.regenerated
    if regen is not None:
        typer.echo(
            f"regenerated {regen.rows} trained rows with {regen.engine} in {regen.chunks} "
            f"decode batches: {regen.identical} identical, {regen.rows - regen.identical} differ"
            + (f", {regen.unrecorded} not recorded (agent episodes)" if regen.unrecorded else "")
        )
        if regen.engine == "vllm" and regen.identical < regen.rows:
            typer.echo(
                "vLLM does not promise the same tokens for the same seeds (its batched "
                "kernels vary with the batch, on GPU): the first difference follows"
            )
    if report.counterfactual:
        typer.echo("a counterfactual (--set): nothing compared with the record")
    elif report.divergences:
        typer.echo(
            f"DIVERGED at {report.divergences[0]} "
            f"({len(report.divergences)} of {report.compared} values differ)",
            err=True,
        )
        raise typer.Exit(1)
    else:
        typer.echo(f"identical: {report.compared} values equal the record bit for bit")
