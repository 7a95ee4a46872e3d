"""The rollouts' record of their generations, and ``relax replay --regenerate``'s check of it.

The trainer's record (``relax.replay._record``) says which rows each step trained; it cannot
say how a row was generated. Each rollout therefore appends one JSON line per generate call
of the HF engine to ``record/generations/<replica>.jsonl``:

``{"engine", "uids", "prompts", "seeds", "params", "max_batch_size", "device", "threads",
"chunks", "kept", "runs"}``
    the engine ("hf" or "vllm"), the prompt rows' uids and token ids, their sampling seeds,
    the sampling parameters, how the engine cut the call's ``n`` samples per prompt into
    decode batches (vLLM: the whole call is one), its device and
    torch thread count, per batch (chunk) the weights version of every decode step — one
    version throughout, or the switches of an interruptible generation — with
    ``rollout.stop``, how many tokens of each generation the stop strings kept, and (vLLM) each
    generation's ``[version, tokens]`` runs: vLLM resumes every request at a weight update
    from its own prefix, so a regeneration replays each generation's own segments.

A regeneration decodes such a chunk again (``HFEngine.regenerate``): the same rows in the same
batch (a row's logprobs depend on its batch in the last bits), each from its seeded generator,
on the replay's own weights of each version (bit for bit the run's, which the trainer's
replay checks), and compares every trained row's tokens and logprobs with the record. A
retried prompt (a rollout killed after generating) has several calls; the row must equal one
of them. Lines are flushed, not fsynced: a rollout killed mid-call leaves its rows
unrecorded, counted as such, never wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relax.errors import RecordError

GENERATIONS_DIR = "generations"
"""Under ``record/``: one file per rollout replica."""


def version_runs(gen: Any) -> list[list[int]]:
    """``gen``'s tokens as ``[version, count]`` runs, oldest first."""
    runs: list[list[int]] = []
    for version in gen.token_versions or [gen.version] * len(gen.response_ids):
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([version, 1])
    return runs


def call_versions(call: dict[str, Any], chunk: int) -> set[int]:
    """Every weights version regenerating ``call``'s ``chunk`` needs."""
    versions = set(call["chunks"][chunk])
    return versions | {v for runs in call.get("runs") or [] for v, _ in runs}


def chunk_schedules(gens: list[Any], max_batch_size: int) -> list[list[int]]:
    """Per decode batch of ``gens`` (a call's generations, in order), the version of every
    decode step: the longest row's ``token_versions`` (the batch decodes until its last row
    ends)."""
    return [
        max((list(g.token_versions or [g.version]) for g in gens[s : s + max_batch_size]), key=len)
        for s in range(0, len(gens), max_batch_size)
    ]


class GenerationLog:
    """A rollout's appender of its generate calls (see the module docstring)."""

    def __init__(self, record_dir: Path, replica: str) -> None:
        folder = record_dir / GENERATIONS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{replica}.jsonl"
        self._file = open(self.path, "a+b")  # noqa: SIM115 - open for the rollout's lifetime
        # A predecessor killed mid-line left a torn line: end it, so ours starts clean.
        if self._file.tell() > 0:
            self._file.seek(-1, os.SEEK_END)
            if self._file.read(1) != b"\n":
                self._file.write(b"\n")

    def call(
        self,
        prompts: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        seeds: list[int],
        params: Any,
        engine: Any,
        gens: list[Any],
        kept: list[int] | None = None,
        kind: str = "hf",
    ) -> None:
        """One call: ``gens`` as the engine returned them (before any stop string cut them to
        ``kept`` tokens)."""
        import torch

        # The HF engine decodes a call in batches of max_batch_size; vLLM schedules the whole
        # call itself (one chunk, replayed as one LLM.generate).
        batch = getattr(engine, "max_batch_size", None) or max(len(gens), 1)
        device = engine.weights_device  # None: vLLM's workers, on the platform's device
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        line = {
            "engine": kind,
            "uids": [r["uid"] for r in prompts],
            "prompts": prompt_ids,
            "seeds": seeds,
            "params": asdict(params),
            "max_batch_size": batch,
            "device": str(device),
            "threads": torch.get_num_threads(),
            "chunks": chunk_schedules(gens, batch),
            "kept": kept,
        }
        if kind == "vllm":
            line["runs"] = [version_runs(g) for g in gens]
        self._file.write(json.dumps(line).encode() + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_calls(record_dir: Path) -> list[dict[str, Any]]:
    """Every recorded call of every replica (a torn line is skipped: its rows are unrecorded)."""
    calls = []
    for path in sorted((record_dir / GENERATIONS_DIR).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                calls.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return calls


@dataclass
class RegenerateReport:
    engine: str = "hf"
    """The engine that generated the run and regenerated it ("hf" or "vllm")."""
    rows: int = 0
    """Trained rows regenerated and compared."""
    identical: int = 0
    unrecorded: int = 0
    """Trained rows no recorded call generated (an agent's episodes, a call cut by a kill)."""
    chunks: int = 0
    """Decode batches regenerated."""
    held_max: int = 0
    """Most weight versions held at once for chunks still to come."""


def _sample_of(uid: str) -> tuple[str, int]:
    prompt, _, index = uid.rpartition("/")
    return prompt, int(index)


def first_difference(
    recorded: Mapping[str, Any], regenerated: Any, kept: int | None = None
) -> tuple[str, Any, Any] | None:
    """Where a regenerated row (its first ``kept`` tokens) first differs from the trained one,
    with the two values (``None``: equal, bit for bit)."""
    tokens, logprobs = list(recorded["response_ids"]), list(recorded["logprobs"])
    again = list(regenerated.response_ids[:kept])
    if again != tokens:
        n = next((i for i, (a, b) in enumerate(zip(tokens, again, strict=False)) if a != b), None)
        if n is None:  # one is a prefix of the other
            return "response length", len(tokens), len(again)
        return f"token {n}", tokens[n], again[n]
    for n, (a, b) in enumerate(zip(logprobs, regenerated.logprobs[:kept], strict=True)):
        if a != b:
            return f"logprob of token {n}", a, b
    return None


class Regenerator:
    """Regenerates the trained rows of a replay as their rollouts generated them.

    Built before the replay with every step's trained uids; the replay then tells it each
    version it produces (``produced``: kept while a chunk still to come needs it) and hands it
    each step's rows (``check``) once the versions those rows were generated with exist.
    """

    def __init__(self, record_dir: Path, cfg: Any, model_dir: str, trained: list[str]) -> None:
        self.cfg, self.model_dir = cfg, model_dir
        self.calls = read_calls(record_dir)
        if not self.calls:
            raise RecordError(
                f"no recorded generations in {record_dir / GENERATIONS_DIR} (a run from "
                "before the record had them, or one whose rows came from agents)"
            )
        kinds = {c.get("engine", "hf") for c in self.calls}
        if len(kinds) > 1:
            raise RecordError(f"the run's rollouts generated with several engines: {kinds}")
        self.engine_kind = kinds.pop()
        devices = {c["device"] for c in self.calls}
        if self.engine_kind == "hf" and devices != {"cpu"}:
            # The HF engine regenerates on the CPU: a GPU's kernels round otherwise.
            raise RecordError(f"the run generated on {sorted(devices)}: HF regenerates CPU runs")
        if "cpu" not in devices:
            import torch

            if not torch.cuda.is_available():
                raise RecordError(f"the run generated on {sorted(devices)}: this machine has none")
        if self.engine_kind == "vllm" and cfg.model.lora is not None:
            raise RecordError("--regenerate with vLLM serves full weights, not LoRA adapters")
        if any(s is None for c in self.calls for s in c["seeds"]):
            raise RecordError("the run sampled unseeded (rollout.seed unset): nothing to replay")
        where: dict[str, list[tuple[int, int]]] = {}
        for i, call in enumerate(self.calls):
            for position, uid in enumerate(call["uids"]):
                where.setdefault(uid, []).append((i, position))
        # Each trained row's candidates: every call that generated its prompt, as (the call,
        # the row's chunk in it, the row's place in the call).
        self.candidates: dict[str, list[tuple[int, int, int]]] = {}
        for uid in trained:
            prompt, index = _sample_of(uid)
            for i, position in where.get(prompt, []):
                call = self.calls[i]
                job = position * call["params"]["n"] + index
                chunk = job // call["max_batch_size"]
                self.candidates.setdefault(uid, []).append((i, chunk, job))
        uses = Counter((i, c) for rows in self.candidates.values() for i, c, _ in rows)
        self._uses = uses  # references of rows still to check, per chunk
        self._needed = Counter(v for (i, c) in uses for v in call_versions(self.calls[i], c))
        self._held: dict[int, dict[str, Any]] = {}
        self._done: dict[tuple[int, int], list[Any]] = {}  # regenerated chunks, while needed
        self.report = RegenerateReport(engine=self.engine_kind)
        self._engine: Any = None

    def produced(self, version: int, state: Mapping[str, Any]) -> None:
        """The replay holds ``version``'s weights now; keep a copy if a chunk needs them."""
        if self._needed[version] > 0 and version not in self._held:
            self._held[version] = {k: v.detach().clone() for k, v in state.items()}
            self.report.held_max = max(self.report.held_max, len(self._held))

    def check(self, rows: list[dict[str, Any]]) -> list[tuple[str, tuple[str, Any, Any]]]:
        """Regenerate and compare ``rows`` (one step's); ``(uid, (where, recorded,
        regenerated))`` for each that equals none of its recorded generations."""
        differences = []
        for row in rows:
            candidates = self.candidates.get(row["uid"], [])
            if not candidates:
                self.report.unrecorded += 1
                continue
            self.report.rows += 1
            found = []
            for i, c, job in candidates:
                regenerated = self._chunk((i, c))
                if regenerated is not None:
                    kept = self.calls[i].get("kept")
                    found.append(
                        first_difference(row, regenerated[job], None if kept is None else kept[job])
                    )
                self._release((i, c))
            if None in found:
                self.report.identical += 1
            else:
                never = ("was generated with versions the replay never produced", None, None)
                differences.append((row["uid"], found[-1] if found else never))
        return differences

    def _chunk(self, chunk: tuple[int, int]) -> list[Any] | None:
        """The call's generations with ``chunk`` regenerated (``None``: a version it needs does
        not exist in the replay yet — a retry generated after this step)."""
        if chunk in self._done:
            return self._done[chunk]
        i, c = chunk
        call = self.calls[i]
        if any(v not in self._held for v in call_versions(call, c)):
            return None
        import torch

        from relax.engines import HFEngine, SamplingParams, open_engine

        cfg = self.cfg
        if self._engine is None and self.engine_kind == "vllm":
            self._engine = open_engine(cfg.rollout, self.model_dir, cfg.model.dtype)
        elif self._engine is None:
            self._engine = HFEngine.from_pretrained(
                self.model_dir, cfg.model.dtype, lora=cfg.model.lora
            )
        engine = self._engine
        if isinstance(engine, HFEngine):
            engine.max_batch_size = call["max_batch_size"]
        threads = torch.get_num_threads()
        torch.set_num_threads(call["threads"])  # the sums' split, as the rollout's
        try:
            schedules = [s if k == c else None for k, s in enumerate(call["chunks"])]
            runs = {"runs": call["runs"]} if call.get("runs") is not None else {}
            gens = engine.regenerate(
                call["prompts"],
                SamplingParams(**call["params"]),
                call["seeds"],
                schedules,
                self._held.__getitem__,
                **runs,
            )
        finally:
            torch.set_num_threads(threads)
        self.report.chunks += 1
        self._done[chunk] = gens
        return gens

    def close(self) -> None:
        """Close the engine (vLLM's in-process workers); from sync code, even under a loop."""
        engine, self._engine = self._engine, None
        if engine is not None:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, engine.close()).result()

    def _release(self, chunk: tuple[int, int]) -> None:
        self._uses[chunk] -= 1
        if self._uses[chunk] > 0:
            return
        self._done.pop(chunk, None)
        i, c = chunk
        for v in call_versions(self.calls[i], c):
            self._needed[v] -= 1
            if self._needed[v] == 0:
                self._held.pop(v, None)
