"""The rollout role: prompts in, scored-to-be samples out, always on the freshest weights.

Loop: lease a batch of prompts from the prompt bus; ask the sample bus for permission
(``admit``) to generate each prompt's group with the weights held (staleness pacing); generate
``n`` samples per prompt; put them (uid = prompt id + sample index, stable across retries);
ack the prompts. A rollout killed anywhere in between loses nothing: the prompt lease expires
and the work is redone under the same uids — and, sampling being seeded by prompt id, with
the same samples.

Weights: a follower task long-polls the weights channel and loads each new version as soon as
it is published. With ``rollout.interruptible`` the update lands between two tokens of a
generation in flight (partial rollout: every token's version is recorded in the
``token_versions`` column and the row is stamped with its oldest); otherwise it waits for the
generation to end. A restarted rollout loads the current version before it serves.

Agents (``[rollout.agent]``): with kind "env" a sample is a multi-turn episode of an
environment, with kind "openai" a session of an agent program that reaches the policy only
through this rollout's OpenAI-compatible endpoint (``[rollout.server]``), and with kind
"external" the rollout takes no prompts at all: users' own programs generate through the
endpoint and submit finished sessions (``POST /relax/v1/sessions/{id}/finish``), which become
rows. Episodes and endpoint calls share one ``Sampler``, so concurrent turns batch together.
Each replica serving the endpoint writes its URL and API key to
``RUN_DIR/endpoints/<replica>.json`` (readable only by the user).

Pause: the control endpoint's pause state lives in ``RUN_DIR/paused`` (``PAUSE_FILE``),
written before the rollouts are told and removed before they are told to resume, so a rollout
restarted at any moment reads the state the control endpoint reports (``on_start``) and a
restarted paused rollout generates nothing until ``resume``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from relax.actors import Actor
from relax.agents import AgentServer, Sampler, SessionStore, Trajectory, cut_at_stop
from relax.bus import BusClient, WeightSubscriber, plane_options
from relax.config import ClusterConfig
from relax.engines import (
    EngineError,
    Generation,
    GenerationEngine,
    SamplingParams,
    open_engine,
)
from relax.media import mm_from_wire
from relax.models import load_processor, load_tokenizer, stop_token_ids
from relax.replay import RECORD_DIR, GenerationLog
from relax.roles._common import (
    as_list,
    client_name,
    cluster_config,
    connect_bus,
    prompt_seed,
    stall_point,
    well_formed,
    without_poisoned,
)
from relax.roles._episodes import env_rows, program_rows
from relax.roles._lengths import LengthBook
from relax.roles._reward import Scorer
from relax.runfiles import pause_requested
from relax.schema import (
    LOGPROBS,
    MM_INPUTS,
    PROMPT_IDS,
    RESPONSE_IDS,
    ROUTED_EXPERTS,
    TOKEN_VERSIONS,
)

PROMPT_FOR_REWARD = {"text": "prompt_text", "messages": "messages", "fields": "fields"}
"""Prompt-row columns copied onto each sample row (as named here) for the reward role."""


async def generate_groups(
    engine: GenerationEngine,
    cfg: ClusterConfig,
    prompts: list[dict[str, Any]],
    stops: list[int],
    log: GenerationLog | None = None,
    on_group: Callable[[int, list[Generation]], None] | None = None,
) -> list[Generation]:
    """``data.n_samples_per_prompt`` samples of each prompt row, as ``[rollout]`` says, each
    prompt seeded by its id (see the module docstring); a seeded text call goes to ``log``
    (what ``relax replay --regenerate`` decodes again). ``on_group(i, gens)``: prompt ``i``'s
    samples, as returned, the moment the last of them ended (an engine that
    ``finishes_early`` reports them shortest first, any other once the call is done)."""
    rollout = cfg.rollout
    media = [r["columns"].get(MM_INPUTS) for r in prompts]
    # Media travel with their prompt as processed once by the dataset role: the engine sees
    # the very tensors the trainer will.
    extra = (
        {"mm_inputs": [None if m is None else mm_from_wire(m) for m in media]}
        if any(m is not None for m in media)
        else {}
    )
    prompt_ids = [as_list(r["columns"][PROMPT_IDS]) for r in prompts]
    params = SamplingParams.from_rollout(
        rollout, n=cfg.data.n_samples_per_prompt, stop_token_ids=stops
    )
    seeds = None if rollout.seed is None else [prompt_seed(rollout.seed, r["uid"]) for r in prompts]
    tokenizer = getattr(engine, "tokenizer", None)
    if rollout.stop and tokenizer is None:
        raise EngineError("rollout.stop needs an engine with a tokenizer")

    def cut(gen: Generation) -> Generation:
        return stop_at_strings(gen, tokenizer, rollout.stop) if rollout.stop else gen

    if on_group is not None:
        n, groups = params.n, [dict[int, Generation]() for _ in prompts]

        def finished(sequence: int, gen: Generation) -> None:
            group = groups[sequence // n]
            group[sequence % n] = cut(gen)
            if len(group) == n:
                on_group(sequence // n, [group[k] for k in range(n)])

        extra["on_finished"] = finished
    raw = await engine.generate(prompt_ids, params, seeds=seeds, **extra)
    gens = [cut(g) for g in raw] if rollout.stop else raw
    if log is not None and seeds is not None and not extra and engine.regenerates:
        kept = [len(g.response_ids) for g in gens] if rollout.stop else None
        log.call(prompts, prompt_ids, seeds, params, engine, raw, kept, rollout.engine)
    return gens


def stop_at_strings(gen: Generation, tokenizer: Any, stops: Sequence[str]) -> Generation:
    """``gen`` ended after the token that completes the first of ``stops`` (kept, as the
    policy sampled it); unchanged when none occurs."""
    kept, _, stopped = cut_at_stop(tokenizer, gen.response_ids, stops)
    if not stopped:
        return gen
    versions, routed = gen.token_versions, gen.routed_experts
    return replace(
        gen,
        response_ids=gen.response_ids[:kept],
        logprobs=gen.logprobs[:kept],
        finish_reason="stop",
        token_versions=None if versions is None else versions[:kept],
        routed_experts=None if routed is None else routed[: len(gen.prompt_ids) + kept],
    )


class RolloutRole(Actor):
    def __init__(
        self,
        *,
        config: dict[str, Any],
        prompts_url: str,
        samples_url: str,
        model_dir: str,
        run_dir: str | None = None,
    ) -> None:
        self.cfg = cluster_config(config)
        self.prompts_url, self.samples_url, self.model_dir = prompts_url, samples_url, model_dir
        self.run_dir = Path(run_dir) if run_dir else None
        self.engine: GenerationEngine | None = None
        self.generations: GenerationLog | None = None
        self.sampler: Sampler | None = None
        self.sessions: SessionStore | None = None
        self.server: AgentServer | None = None
        self._samples: BusClient | None = None
        self.episodes: dict[str, int] = {}  # episodes by how they ended
        self._new_weights: asyncio.Condition | None = None
        self._plane: WeightSubscriber | None = None  # [weights] transport = "group"
        self._loading = asyncio.Lock()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._idle = asyncio.Event()  # set between rounds
        self._idle.set()
        self._start_version: int | None = None  # what it held before serving anything
        self.lengths = LengthBook()  # [rollout] schedule = "shortest_first"
        self.scorer: Scorer | None = None  # [reward] in_rollout: samples scored here
        self._on_policy = self.cfg.staleness == 0  # as the samples bus last said: take turns

    async def on_start(self) -> None:
        # A restart while paused comes back paused: the control endpoint still says so.
        if pause_requested(self.run_dir):
            self._unpaused.clear()
        # In a worker thread: starting vLLM takes seconds, and heartbeats must keep flowing.
        # With [model.lora] the engine serves the adapters the trainer publishes (adapter
        # tensors only; the base stays this folder's).
        self.engine = await asyncio.to_thread(
            open_engine,
            self.cfg.rollout,
            self.model_dir,
            self.cfg.model.dtype,
            lora=self.cfg.model.lora,
        )
        rollout = self.cfg.rollout
        if self.cfg.reward.in_rollout and rollout.agent.kind == "single":
            # The reward role's own tokenizer and functions: the same rewards, bit for bit.
            self.scorer = Scorer(self.cfg, load_tokenizer(self.model_dir), self.log)
            await self.scorer.load()
        if self.run_dir is not None and self.cfg.trainer.record:  # for relax replay --regenerate
            self.generations = GenerationLog(self.run_dir / RECORD_DIR, self.context.id)
        if rollout.agent.kind != "single" or rollout.serves():
            self.tokenizer = getattr(self.engine, "tokenizer", None) or load_tokenizer(
                self.model_dir
            )
            self.sampler = Sampler(self.engine)
            # None for a text-only model; with it, episodes may carry media.
            self.processor = await asyncio.to_thread(load_processor, self.model_dir)
            self.sessions = SessionStore(self.tokenizer, max_sessions=rollout.server.max_sessions)

    async def on_stop(self) -> None:
        if self.generations is not None:
            self.generations.close()
        if self.server is not None:
            await self.server.aclose()
            if self.run_dir is not None:  # nobody may connect to a stopped endpoint
                (self.run_dir / "endpoints" / f"{self.context.id}.json").unlink(missing_ok=True)
        if self.sampler is not None:
            await self.sampler.aclose()
        if self._plane is not None:
            await self._plane.aclose()
        if self.engine is not None:
            await self.engine.close()

    def version(self) -> int:
        """The weights version this rollout serves."""
        return self.engine.version if self.engine else -1

    async def pause(self) -> bool:
        """Stop taking new prompts; returns once the round in flight is put (weights still
        follow while paused)."""
        self._unpaused.clear()
        await self._idle.wait()
        return True

    def resume(self) -> bool:
        """Take prompts again after ``pause``."""
        self._unpaused.set()
        return False

    def paused(self) -> bool:
        """Whether this rollout is paused (takes no prompts)."""
        return not self._unpaused.is_set()

    def statistics(self) -> dict[str, Any]:
        """The engine's counters (requests, tokens, weight loads, interrupted loads, …), and
        the endpoint's and episodes' when there are any."""
        stats: dict[str, Any] = dict(self.engine.statistics()) if self.engine else {}
        if self.server is not None:
            stats["endpoint"] = {"url": self.server.url, **self.server.statistics()}
        if self.episodes:
            stats["episodes"] = dict(self.episodes)
        if self._plane is not None:
            stats["weight_plane"] = self._plane.statistics()
        if self._start_version is not None:  # a replica added or restarted mid-run: >= current
            stats["start_version"] = self._start_version
        if self.cfg.rollout.schedule == "shortest_first":
            stats["lengths"] = self.lengths.statistics()
        if self.scorer is not None:
            stats["reward"] = self.scorer.statistics()
        return stats

    async def _sync_weights(self, bus: BusClient, wait: float) -> bool:
        """Load the newest published version, if newer than ours; True when one was loaded."""
        assert self.engine is not None and self._new_weights is not None
        if self._plane is not None:  # over the group, verified; from the bus when it must
            got = await self._plane.next(self.engine.version, wait=wait)
        else:
            got = await bus.poll_weights(after=self.engine.version, wait=wait)
        if got is None:
            return False
        async with self._loading:  # the follower and a "behind" admission may both fetch
            if got[0] <= self.engine.version:
                return False
            await self.engine.load_weights(*got)  # atomic: no forward pass sees a mix
        async with self._new_weights:
            self._new_weights.notify_all()
        self.log.debug("weights loaded", version=got[0])
        return True

    async def _follow_weights(self, bus: BusClient) -> None:
        while True:
            await self._sync_weights(bus, wait=30.0)

    async def _newer_within(self, version: int, timeout: float) -> bool:
        """Whether the engine serves a version above ``version`` within ``timeout`` seconds
        (the follower loads it)."""
        assert self.engine is not None and self._new_weights is not None
        async with self._new_weights:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._new_weights.wait_for(lambda: self.engine.version > version), timeout
                )
        return self.engine.version > version

    async def run(self) -> None:
        assert self.engine is not None
        cfg, engine = self.cfg, self.engine
        n = cfg.data.n_samples_per_prompt
        stops = stop_token_ids(engine.tokenizer) if hasattr(engine, "tokenizer") else []
        # Each replica its own client name (the prompt bus tells turn holders apart by it).
        name = client_name(self.context)
        self._new_weights = asyncio.Condition()
        async with (
            await connect_bus(self.prompts_url, cfg, f"{name}-prompts") as prompts,
            await connect_bus(self.samples_url, cfg, name) as samples,
            await connect_bus(self.samples_url, cfg, f"{name}-weights") as weights,
        ):
            if cfg.weights.transport == "group":
                # A new member each start: a restarted rollout's old self leaves with its lease.
                member = f"{self.context.id}-{self.context.rank}-{secrets.token_hex(4)}"
                options = plane_options(cfg.weights, self.samples_url)
                self._plane = WeightSubscriber(
                    weights, member, options, device=self.engine.weights_device
                )
            await self._sync_weights(weights, wait=0)  # serve the current version first
            self._start_version = self.engine.version
            follower = asyncio.create_task(self._follow_weights(weights))
            self._samples = samples
            try:
                if self.cfg.rollout.serves():
                    await self._serve_endpoint(stops)
                if self.cfg.rollout.agent.kind == "external":
                    await follower  # serve until stopped; fail if weights stop following
                while True:
                    if follower.done():
                        follower.result()  # the follower failed: fail the role with its error
                    await self._unpaused.wait()
                    self._idle.clear()
                    try:
                        await self._round(prompts, samples, n, stops)
                    finally:
                        self._idle.set()
            finally:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
                if self._plane is not None:  # stopping (drained, restarted): out of the group now
                    await self._plane.leave()

    async def _serve_endpoint(self, stops: list[int]) -> None:
        """Start the OpenAI-compatible endpoint and write where it is to the run folder."""
        assert self.sampler is not None and self.sessions is not None
        server_cfg = self.cfg.rollout.server
        replica = int(self.context.id.rsplit("-", 1)[-1]) if self.context.id[-1:].isdigit() else 0
        api_key = (
            os.environ.get(server_cfg.api_key_env)
            if server_cfg.api_key_env
            else secrets.token_urlsafe(24)
        )
        if server_cfg.api_key_env and not api_key:
            raise RuntimeError(
                f"rollout.server.api_key_env: the environment variable {server_cfg.api_key_env}"
                " is not set"
            )
        self.server = AgentServer(
            sampler=self.sampler,
            tokenizer=self.tokenizer,
            sessions=self.sessions,
            api_key=api_key,
            model_name=server_cfg.model_name,
            host=server_cfg.host,
            port=server_cfg.port + replica if server_cfg.port else 0,
            stop_token_ids=stops,
            max_model_len=self.engine.max_model_len if self.engine else None,
            default_max_tokens=self.cfg.rollout.max_new_tokens,
            on_finish=self._submit,
        )
        url = await self.server.start()
        self.api_key = api_key
        if self.run_dir is not None:
            folder = self.run_dir / "endpoints"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{self.context.id}.json"
            data = {"url": url, "api_key": api_key, "model": server_cfg.model_name}
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
        self.log.info("endpoint serving", url=url)

    async def _submit(self, session: str, traj: Trajectory, body: dict[str, Any]) -> None:
        """A session an external program finished: one row on the sample bus."""
        assert self._samples is not None
        size = body.get("group_size", 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"group_size must be a positive integer, got {size!r}")
        traj.info["session"] = session
        row = {
            "uid": str(body.get("uid") or session),
            "group": str(body.get("group") or session),
            "group_size": size,
            "version": max(traj.version, 0),
            "columns": traj.columns(),
        }
        await self._samples.put([row], wait=3600)
        self._count([traj])

    def _count(self, trajs: list[Trajectory]) -> None:
        for traj in trajs:
            end = traj.end or "done"
            self.episodes[end] = self.episodes.get(end, 0) + 1
            if end not in ("done", "max_turns", "token_budget"):
                self.log.warning("episode ended by a failure", end=end, reason=traj.reason)

    async def _round(
        self, prompts: BusClient, samples: BusClient, n: int, stops: list[int]
    ) -> None:
        """Lease prompts, admit what pacing allows, generate, put, ack.

        At staleness 0 the replicas take turns from lease to admission: a version's groups
        are then the next prompts in the stream, as in the synchronous loop. (Without turns a
        replica held up between the two saw another's later prompts admitted first, and the
        step trained other prompts than ``relax up --sync`` does.) The bound is the one the
        samples bus last reported, so a live ``relax set staleness`` applies from the next
        round.
        """
        cfg, engine = self.cfg, self.engine
        assert engine is not None
        in_turn = self._on_policy
        batch = await prompts.take_batch(
            "rollout", batch_size=cfg.rollout.batch_size, wait=1.0, turn=in_turn
        )
        if batch.rows:
            await stall_point(self.run_dir, "after_lease", self.context.id)
        if not (await without_poisoned(prompts, batch, self.log)).rows:  # e.g. str prompt_ids
            return  # (every row dropped: the lease, and with it the turn, ended)
        admitted: list[dict[str, Any]] = []
        waiting = list(batch.rows)
        while waiting:
            version = engine.version
            # In order, one request; while nothing is admitted yet the bus waits (up to 5 s)
            # for the first to be admitted or to fall "behind": with some admitted, generate
            # those now.
            reply = await samples.admit_many(
                [r["uid"] for r in waiting], n, version, wait=0.0 if admitted else 5.0
            )
            verdicts, self._on_policy = reply["verdicts"], reply["staleness"] == 0
            ok = len(verdicts) - (verdicts[-1] != "ok")  # the admitted lead the verdicts
            admitted += waiting[:ok]
            waiting = waiting[ok:]
            if not waiting:
                break
            if verdicts[ok] == "behind":  # our weights are too old: the follower brings newer
                timeout = cfg.rollout.weight_sync_timeout
                if not await self._newer_within(version, timeout):
                    self.log.warning("no newer weights yet", version=version, waited_s=timeout)
                continue
            break  # the rest would be refused too: generate what was admitted now
        if waiting or in_turn:  # waiting: the trainer is behind, these go back for later
            await prompts.release(replace(batch, rows=waiting), end_turn=in_turn)
        if not admitted:
            return
        kind = cfg.rollout.agent.kind
        if kind == "env":
            assert self.sampler is not None
            rows, trajs = await env_rows(
                cfg, self.sampler, self.tokenizer, admitted, stops, self.processor
            )
            self._count(trajs)
        elif kind == "openai":
            assert self.sessions is not None and self.server is not None
            rows, trajs = await program_rows(
                cfg, self.sessions, self.server.session_url, self.api_key, admitted
            )
            self._count(trajs)
        elif cfg.rollout.schedule == "shortest_first":
            rows = []
            await self._rows_as_they_finish(admitted, n, stops, samples)
        else:
            rows = await self._single_rows(admitted, n, stops)
        if rows:
            await self._put_samples(samples, rows)
        await prompts.ack(replace(batch, rows=admitted))

    async def _put_samples(self, samples: BusClient, rows: list[dict[str, Any]]) -> None:
        """Put generated rows on the samples bus. With ``[reward] in_rollout`` they are scored
        here first and go scored: no reward role, no bus round trips between generation and
        the trainer. A group whose reward failed is dropped by the bus in the same request."""
        rows = well_formed(rows, self.log)
        failed_groups: set[str] = set()
        if self.scorer is not None and rows:
            scored, failed = await self.scorer.score(rows)
            columns = dict(scored)
            for row in rows:
                row["columns"].update(columns.get(row["uid"], {}))
            failed_uids = set(failed)
            failed_groups = {row["group"] for row in rows if row["uid"] in failed_uids}
        await samples.put(rows, wait=3600, failed_groups=failed_groups)
        await stall_point(self.run_dir, "after_put", self.context.id)  # a test hook
        if self.scorer is not None:
            self.scorer.check()  # after the failed groups' drops are on the bus

    async def _single_rows(
        self, admitted: list[dict[str, Any]], n: int, stops: list[int]
    ) -> list[dict[str, Any]]:
        """One reply per sample, scored later by the reward role."""
        cfg, engine = self.cfg, self.engine
        assert engine is not None
        gens = await generate_groups(engine, cfg, admitted, stops, self.generations)
        return sample_rows(admitted, gens, n)

    async def _rows_as_they_finish(
        self, admitted: list[dict[str, Any]], n: int, stops: list[int], samples: BusClient
    ) -> None:
        """Length-aware: the batch shortest expected first, each group put the moment its
        last sample ended (in the order they end), and the lengths remembered."""
        cfg, engine = self.cfg, self.engine
        assert engine is not None
        ordered = self.lengths.order(admitted)
        ready: asyncio.Queue[list[dict[str, Any]] | None] = asyncio.Queue()

        def on_group(i: int, gens: list[Generation]) -> None:
            self.lengths.observe(gens[0].prompt_ids, [len(g.response_ids) for g in gens])
            ready.put_nowait(sample_rows([ordered[i]], gens, n))

        async def put_groups() -> None:
            while (rows := await ready.get()) is not None:
                await self._put_samples(samples, rows)

        putting = asyncio.create_task(put_groups())
        try:
            await generate_groups(engine, cfg, ordered, stops, self.generations, on_group)
        except BaseException:
            putting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await putting
            raise
        ready.put_nowait(None)  # every group is queued by now: put the rest, then done
        await putting


def sample_rows(prompts: list[dict[str, Any]], gens: list[Any], n: int) -> list[dict[str, Any]]:
    """The sample rows a rollout puts on the bus for ``prompts`` (a group of ``n`` each) from
    their generations (``gens[i * n + j]``: prompt ``i``'s sample ``j``); the strictly synchronous
    loop scores these very rows."""
    rows = []
    for i, row in enumerate(prompts):
        for j in range(n):
            g = gens[i * n + j]
            columns = {
                PROMPT_IDS: list(g.prompt_ids),
                RESPONSE_IDS: list(g.response_ids),
                LOGPROBS: list(g.logprobs),
                "answer": row["columns"]["answer"],
            }
            if MM_INPUTS in row["columns"]:  # the same processed media, for training
                columns[MM_INPUTS] = row["columns"][MM_INPUTS]
            # What the reward function sees of the prompt (relax.rewards.Sample).
            for source, name in PROMPT_FOR_REWARD.items():
                if source in row["columns"]:
                    columns[name] = row["columns"][source]
            if g.token_versions is not None:
                columns[TOKEN_VERSIONS] = list(g.token_versions)
            if g.routed_experts is not None:  # an MoE policy's routing, for R3
                columns[ROUTED_EXPERTS] = g.routed_experts
            rows.append(
                {
                    "uid": f"{row['uid']}/{j}",
                    "group": row["uid"],
                    "group_size": n,
                    "version": g.version,
                    "columns": columns,
                }
            )
    return rows
