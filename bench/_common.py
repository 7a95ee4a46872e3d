"""What the training benchmarks share: the recipe, timed cluster runs, and one step's costs.

- ``limit_threads(n)``: call first, before torch is imported. Sets ``OMP_NUM_THREADS`` (and
  friends), which every role process the cluster spawns inherits, and this process's torch.
- ``recipe(staleness, steps, scale)``: ``examples/digits/cluster.toml`` with rollout and trainer
  each in their own process, optionally scaled up (``SCALES``) so that the per-step work is
  large against the fixed costs of moving rows and weights between processes.
- ``timed_run(cfg)``: one real ``relax.cluster.run``; every ``metrics.jsonl`` line is
  timestamped as it appears (polled every few ms), so start-up and shut-down can be left out.
- ``StepCosts``: one step's work done directly with the classes the roles use — T_gen (the
  rollout engine from ``open_engine`` generating one step's samples) and T_train (a
  ``TorchBackend`` step on those samples) — in this process, one after the other.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "digits" / "cluster.toml"

SCALES: dict[str, tuple[str, ...]] = {
    # The recipe as shipped: tens of milliseconds of compute per step.
    "digits": (),
    # Same task and batch, a wider model and 32-token answers: generation and training then
    # cost about the same (≈ 0.15-0.2 s each with one thread), far above the per-step fixed costs.
    "scaled": (
        "model.init.hidden_size=256",
        "model.init.intermediate_size=512",
        "rollout.max_new_tokens=32",
    ),
    # About 100 M parameters (12 layers, hidden 768: 104 M) and 128-token answers: bound by
    # the matrix multiplies on any engine. Made for a GPU: on 2 CPU cores a training step of
    # it takes about a minute.
    "100m": (
        "model.init.hidden_size=768",
        "model.init.intermediate_size=3072",
        "model.init.num_layers=12",
        "model.init.num_heads=12",
        "model.init.num_kv_heads=4",
        "rollout.max_new_tokens=128",
    ),
}


def limit_threads(n: int) -> None:
    """Give every torch in this run (this process and the role processes) ``n`` threads."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)


def quiet() -> None:
    """No progress bars, info logs or deprecation warnings from transformers or Relax, here and
    in the processes started from here."""
    import warnings

    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    from relax.log import configure_logging

    configure_logging(level="error")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def recipe(staleness: str, steps: int, scale: str = "scaled", extra: tuple[str, ...] = ()) -> Any:
    """The digits recipe at ``staleness``, rollout and trainer in their own processes."""
    from relax.config import load_config

    overrides = [
        f"trainer.steps={steps}",
        f"staleness={staleness}",
        'rollout.placement="process"',
        'trainer.placement="process"',
        *SCALES[scale],
        *extra,
    ]
    return load_config(DIGITS, overrides=overrides)


def spread_model(folder: Path) -> Path:
    """The scaled model with the wide-spread policy (``tests.tiny.spread_lengths``: responses
    from 1 token to the cap, about half at it), saved under ``folder`` like a checkpoint."""
    from relax.models import build_tiny_model
    from tests.tiny import spread_lengths

    init = recipe("0", 1, "scaled").model.init
    return spread_lengths(build_tiny_model(init, folder / "model"), scale=20.0)


def spread_of(lengths: list[int]) -> list[int]:
    """Minimum, quartiles and maximum of ``lengths``."""
    ordered = sorted(lengths)
    return [ordered[int(q * (len(ordered) - 1))] for q in (0, 0.25, 0.5, 0.75, 1)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


PHASES = ("take_time_s", "gradient_time_s", "update_time_s", "publish_time_s", "wall_s")
"""The trainer's per-step phases as its metrics record them (``wall_s``: the whole step)."""


def phase_line(runs: list[Run], warmup: int) -> str:
    """Where one trainer step's time went: each phase's median (ms) over the timed steps of
    ``runs``, and what the period adds beyond the step's own wall time (the loop, ledger and
    record writes, the rows' bookkeeping)."""
    records = [s for run in runs for s in run.measured(warmup)]
    parts = []
    for key in PHASES:
        values = [float(s[key]) for s in records if key in s]
        parts.append(f"{key.removesuffix('_time_s').removesuffix('_s')} {median(values) * 1e3:.1f}")
    period = median([run.period(warmup) for run in runs])
    walls = [float(s["wall_s"]) for s in records if "wall_s" in s]
    parts.append(f"period - wall {(period - median(walls)) * 1e3:.1f}")
    return "trainer ms/step: " + ", ".join(parts)


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


# --------------------------------------------------------------------------- cluster runs


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def cpu_snapshot() -> dict[int, float]:
    """CPU seconds (user + system) used so far by this process and each of its children
    (Linux ``/proc``; empty elsewhere). Keys in start order: this process, then its children
    by pid (a cluster starts them in tree order: prompts bus, samples bus, trainer, rollout)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, float] = {}
    for pid in [os.getpid(), *sorted(_children(os.getpid()))]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


@dataclass
class Run:
    """One cluster run: when each metrics line appeared, the lines, and CPU use by process."""

    started: float
    ended: float
    stamps: list[float]
    records: list[dict[str, Any]]
    cpu: list[dict[int, float]] = field(default_factory=list)
    """A ``cpu_snapshot()`` taken as each metrics line appeared."""

    def applied(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, r) for t, r in zip(self.stamps, self.records, strict=False) if r.get("applied")]

    def period(self, warmup: int) -> float:
        """Seconds per applied step from the ``warmup``-th applied step to the last."""
        times = [t for t, _ in self.applied()]
        if len(times) < warmup + 2:
            raise RuntimeError(f"only {len(times)} applied steps; need more than {warmup + 1}")
        return (times[-1] - times[warmup]) / (len(times) - 1 - warmup)

    def cpu_per_step(self, warmup: int) -> list[float]:
        """CPU seconds per timed step of each process, in ``cpu_snapshot`` order; processes
        not alive over the whole window are left out."""
        index = [i for i, r in enumerate(self.records) if r.get("applied")]
        if len(index) < warmup + 2 or len(self.cpu) <= index[-1]:
            return []
        first, last = self.cpu[index[warmup]], self.cpu[index[-1]]
        steps = len(index) - 1 - warmup
        return [(last[p] - first[p]) / steps for p in first if p in last]

    def measured(self, warmup: int) -> list[dict[str, Any]]:
        """The records of the steps inside the timed window."""
        return [r for _, r in self.applied()[warmup + 1 :]]


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


async def _watch(path: Path, stamps: list[float], cpu: list[dict], every: float) -> None:
    seen = 0
    while True:
        lines = _count_lines(path)  # a few hundred bytes: cheaper inline than in a thread
        if lines > seen:
            now = time.monotonic()
            snapshot = cpu_snapshot()
            stamps.extend([now] * (lines - seen))
            cpu.extend([snapshot] * (lines - seen))
            seen = lines
        await asyncio.sleep(every)


async def timed_run(cfg: Any, run_dir: str | Path | None = None, *, poll: float = 0.01) -> Run:
    """``relax.cluster.run(cfg)`` with each metrics line timestamped when it appears.

    Without ``run_dir`` the run lives in a temporary folder, removed afterwards."""
    if run_dir is None:
        with tempfile.TemporaryDirectory(prefix="relax-bench-") as tmp:
            return await timed_run(cfg, tmp, poll=poll)
    from relax import cluster

    folder = Path(run_dir)
    stamps: list[float] = []
    cpu: list[dict[int, float]] = []
    watcher = asyncio.create_task(_watch(folder / "metrics.jsonl", stamps, cpu, poll))
    started = time.monotonic()
    try:
        await cluster.run(cfg, folder)
    finally:
        ended = time.monotonic()
        await asyncio.sleep(2 * poll)  # the last line, if it landed just now
        watcher.cancel()
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return Run(started, ended, stamps[: len(records)], records, cpu[: len(records)])


# --------------------------------------------------------------------------- one step's costs


@dataclass
class StepCosts:
    """T_gen and T_train of one step's work, measured with the roles' own classes."""

    cfg: Any
    gen_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    response_tokens: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        from relax.engines import open_engine
        from relax.models import build_tiny_model, load_policy, stop_token_ids
        from relax.rewards import RewardSet
        from relax.roles._prompts import prompt_stream
        from relax.training import TorchBackend

        cfg = self.cfg
        self._dir = tempfile.TemporaryDirectory(prefix="relax-bench-costs-")
        model_dir = build_tiny_model(cfg.model.init, Path(self._dir.name) / "model")
        # The rollout role's engine and the trainer role's backend, built as the roles build them.
        self.engine = open_engine(cfg.rollout, model_dir, cfg.model.dtype)
        self.tokenizer = self.engine.tokenizer
        self.stops = stop_token_ids(self.tokenizer)
        model, tok = load_policy(model_dir, cfg.trainer.dtype)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.backend = TorchBackend(
            model, cfg.trainer, cfg.algorithm, pad_id=pad, temperature=cfg.rollout.temperature
        )
        self.rewards = RewardSet.from_config(
            cfg.reward, answer_key="answer", max_response_tokens=cfg.rollout.max_new_tokens
        )
        self.prompts = prompt_stream(cfg.data.model_dump())

    async def one(self) -> None:
        """Generate one step's samples (timed), score them, train on them (timed)."""
        from relax.engines import SamplingParams

        cfg = self.cfg
        n = cfg.data.n_samples_per_prompt
        per_step = cfg.trainer.global_batch_size // n
        items = list(itertools.islice(self.prompts, per_step))
        prompt_ids = [
            self.tokenizer.encode(i["prompt"], add_special_tokens=False)[
                : cfg.data.max_prompt_tokens
            ]
            for i in items
        ]
        started = time.perf_counter()
        params = SamplingParams.from_rollout(cfg.rollout, n=n, stop_token_ids=self.stops)
        gens = []
        for start in range(0, len(prompt_ids), cfg.rollout.batch_size):  # as the rollout calls it
            gens += await self.engine.generate(
                prompt_ids[start : start + cfg.rollout.batch_size], params
            )
        self.gen_s.append(time.perf_counter() - started)
        rows = []
        for k, g in enumerate(gens):
            item = items[k // n]
            text = self.tokenizer.decode(g.response_ids, skip_special_tokens=True)
            score = await self.rewards.score(
                text, {"answer": item["answer"]}, response_tokens=len(g.response_ids)
            )
            rows.append(
                {
                    "group": item["id"],
                    "uid": f"{item['id']}/{k % n}",
                    "prompt_ids": list(g.prompt_ids),
                    "response_ids": list(g.response_ids),
                    "logprobs": list(g.logprobs),
                    "reward": float(score.reward),
                }
            )
        self.response_tokens.append(sum(len(r["response_ids"]) for r in rows) / len(rows))
        started = time.perf_counter()
        self.backend.step([r for r in rows if r["response_ids"]])
        self.train_s.append(time.perf_counter() - started)

    async def measure(self, reps: int, warmup: int = 1) -> None:
        for _ in range(warmup):
            await self.one()
            self.gen_s.pop()
            self.train_s.pop()
            self.response_tokens.pop()
        for _ in range(reps):
            await self.one()
