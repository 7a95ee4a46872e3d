"""`relax ckpt list` / `relax ckpt export`: a run's trainer checkpoints, and turning one into a
plain Hugging Face model folder (weights, config, tokenizer) for ``from_pretrained``, vLLM or
the Hub. A LoRA checkpoint (``[model.lora]``: it holds the adapter, not the weights) is merged
onto its base model (peft's ``merge_and_unload``), so the folder is a plain model too."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from relax.cli._app import app
from relax.cli._runs import RunDirOption, resolve_run_dir
from relax.errors import RelaxError

ckpt_app = typer.Typer(
    name="ckpt",
    help="List a run's checkpoints, or export one as a Hugging Face model folder.",
    no_args_is_help=True,
)
app.add_typer(ckpt_app, name="ckpt")

CHECKPOINTS = "checkpoints"
META_FILE = "relax_trainer.json"
"""A checkpoint's metadata (``relax.training._checkpoint.META_FILE``; not imported from there,
which would load torch just to list folders)."""
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
"""Besides every ``*.safetensors`` file: what a Hugging Face model folder needs from a checkpoint."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    version: int | None
    size: int
    saved_at: float


def checkpoints_dir(run: Path) -> Path:
    """Where the run's trainer checkpoints are: ``checkpoint.dir`` as recorded by ``relax up``
    in ``run.json``, else ``RUN_DIR/checkpoints``."""
    from relax.cli._up_run_folder import read_run_info

    recorded = read_run_info(run).get("checkpoint_dir")
    return Path(recorded) if recorded else run / CHECKPOINTS


def _step_of(name: str) -> int | None:
    head, _, number = name.partition("-")
    return int(number) if head == "step" and number.isdigit() else None


def list_checkpoints(run: Path) -> list[Checkpoint]:
    """The run's complete checkpoints (``step-N`` folders), oldest first."""
    folder = checkpoints_dir(run)
    found = []
    for path in sorted(folder.glob("step-*")) if folder.is_dir() else []:
        step = _step_of(path.name)
        if step is None or not path.is_dir():
            continue
        meta: dict[str, Any] = {}
        meta_file = path / META_FILE
        if meta_file.is_file():
            try:
                meta = json.loads(meta_file.read_text())
            except json.JSONDecodeError:
                meta = {}
        files = [f for f in path.rglob("*") if f.is_file()]
        found.append(
            Checkpoint(
                path=path,
                step=step,
                version=meta.get("version"),
                size=sum(f.stat().st_size for f in files),
                saved_at=(meta_file if meta_file.exists() else path).stat().st_mtime,
            )
        )
    return found


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@ckpt_app.command("list")
def list_command(
    run_dir: RunDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print them as a JSON list.")] = False,
) -> None:
    """List the run's checkpoints: step, trainer version, size, when it was saved."""
    run = resolve_run_dir(run_dir)
    found = list_checkpoints(run)
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "step": c.step,
                        "version": c.version,
                        "bytes": c.size,
                        "saved_at": c.saved_at,
                        "path": str(c.path),
                    }
                    for c in found
                ],
                indent=2,
            )
        )
        return
    if not found:
        typer.echo(
            f"no checkpoints in {checkpoints_dir(run)} yet: the trainer saves one every "
            "checkpoint.every_steps steps, when training ends and when the run is stopped "
            "(relax down, Ctrl-C)"
        )
        return
    typer.echo(f"{'STEP':>8} {'VERSION':>8} {'SIZE':>10}  {'SAVED':<19}  PATH")
    for c in found:
        saved = dt.datetime.fromtimestamp(c.saved_at).strftime("%Y-%m-%d %H:%M:%S")
        version = "-" if c.version is None else str(c.version)
        typer.echo(f"{c.step:>8} {version:>8} {human_size(c.size):>10}  {saved:<19}  {c.path}")
    typer.echo(f"export one: relax ckpt export latest OUT_DIR --run-dir {run}")


def find_checkpoint(run: Path, which: str) -> Checkpoint:
    """``latest``, a step number, or a folder name ``step-00000012``; exits 2 with the choices."""
    found = list_checkpoints(run)
    if not found:
        typer.echo(
            f"{run} has no checkpoints (in {checkpoints_dir(run)}); the trainer writes one when "
            "training ends or the run is stopped",
            err=True,
        )
        raise typer.Exit(2)
    if which == "latest":
        return found[-1]
    step = int(which) if which.isdigit() else _step_of(which)
    for c in found:
        if c.step == step:
            return c
    steps = ", ".join(str(c.step) for c in found)
    typer.echo(f"no checkpoint {which!r} in {run}; there are steps {steps} (or: latest)", err=True)
    raise typer.Exit(2)


def tokenizer_source(run: Path) -> Path | str | None:
    """Where the run's tokenizer files are: the folder the config named (``model.tokenizer``,
    or ``model.path``), the run's own ``model/`` folder, or ``"byte"`` (the built-in one)."""
    from relax.cli._up_run_folder import read_run_info

    recorded = read_run_info(run).get("tokenizer")
    if recorded and recorded != "byte" and Path(recorded).is_dir():
        return Path(recorded)
    own = run / "model"
    if any((own / name).exists() for name in TOKENIZER_FILES):
        return own
    return "byte" if recorded in (None, "byte") else None


ADAPTER_CONFIG = "adapter_config.json"
"""What marks a LoRA checkpoint (``relax.models``' peft layout; named here so that listing
checkpoints does not import torch)."""


def lora_base(checkpoint: Path, run: Path) -> Path:
    """The base model folder a LoRA checkpoint's adapter merges onto: the one its
    ``adapter_config.json`` names, else the run's model (``run.json``), else ``RUN_DIR/model``."""
    from relax.cli._up_run_folder import read_run_info

    named = json.loads((checkpoint / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    candidates = [named, read_run_info(run).get("model_dir"), str(run / "model")]
    for candidate in candidates:
        if candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate)
    raise FileNotFoundError(
        f"the base model of the LoRA adapter in {checkpoint} is not found (tried"
        f" {[c for c in candidates if c]}); it must stay where the run loaded it from"
    )


def export_checkpoint(checkpoint: Path, run: Path, out: Path) -> list[str]:
    """Copy the model files of ``checkpoint`` (a LoRA checkpoint: its adapter merged onto the
    base model) and the run's tokenizer into ``out``; returns the file names written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if (checkpoint / ADAPTER_CONFIG).is_file():
        from relax.models import merge_lora

        written += merge_lora(lora_base(checkpoint, run), checkpoint, out)
    else:
        for path in sorted(checkpoint.glob("*.safetensors")):
            shutil.copy2(path, out / path.name)
            written.append(path.name)
        if not written:
            raise FileNotFoundError(f"{checkpoint} holds no *.safetensors weights")
        for name in MODEL_FILES:
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, out / name)
                written.append(name)
    source = tokenizer_source(run)
    if isinstance(source, Path):
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
                written.append(name)
    elif source == "byte":
        from relax.models import build_byte_tokenizer

        config = json.loads((out / "config.json").read_text()) if "config.json" in written else {}
        tokenizer = build_byte_tokenizer(int(config.get("max_position_embeddings", 1024)))
        written += [Path(f).name for f in tokenizer.save_pretrained(str(out))]
    return sorted(set(written))


def _complete_step(ctx: typer.Context, incomplete: str) -> list[str]:
    from relax.cli._runs import newest_run

    run = ctx.params.get("run_dir") or newest_run()
    steps = [str(c.step) for c in list_checkpoints(Path(run))] if run else []
    return [s for s in ["latest", *reversed(steps)] if s.startswith(incomplete)]


@ckpt_app.command("export")
def export_command(
    step: Annotated[
        str,
        typer.Argument(
            metavar="STEP|latest",
            help="The checkpoint: a step number or latest.",
            autocompletion=_complete_step,
        ),
    ],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="The folder to write.")],
    run_dir: RunDirOption = None,
    force: Annotated[
        bool, typer.Option("--force", help="Write into OUT_DIR even if it is not empty.")
    ] = False,
) -> None:
    """Export a checkpoint as a Hugging Face model folder.

    OUT_DIR gets the weights (model.safetensors), config.json and the tokenizer files of the
    run's model: ready for AutoModelForCausalLM.from_pretrained(OUT_DIR), vLLM or the Hub.
    A LoRA checkpoint is written merged: the adapter folded into the base model's weights.
    """
    run = resolve_run_dir(run_dir)
    checkpoint = find_checkpoint(run, step)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        typer.echo(
            f"{out_dir} exists and is not empty; pass --force to write into it, or pick a new folder",
            err=True,
        )
        raise typer.Exit(1)
    try:
        written = export_checkpoint(checkpoint.path, run, out_dir)
    except (OSError, ValueError, RelaxError) as exc:  # RelaxError: peft missing for a merge
        typer.echo(f"cannot export {checkpoint.path}: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"exported step {checkpoint.step} of {run} to {out_dir}/: {', '.join(written)}")
    if not any(name in written for name in TOKENIZER_FILES):
        typer.echo(
            "warning: no tokenizer files found for this run; copy them from the base model",
            err=True,
        )
    typer.echo(
        f"load it with: AutoModelForCausalLM.from_pretrained({str(out_dir)!r}) and "
        f"AutoTokenizer.from_pretrained({str(out_dir)!r})"
    )
