"""Media in later turns of an episode: an environment's observation carries an image (audio,
video), played token-in/token-out on the tiny Qwen2.5-Omni thinker.

What is checked: the sequence holds exactly the placeholders of the media the trajectory
accumulated; the row (``prompt_ids + response_ids`` with its ``mm_inputs``, forwarded the
trainer's way) reproduces every reply's sampled log-probs; replies are the sampled ids; the
observations, placeholders included, are masked out of the loss; text episodes are unchanged
by passing a processor; bad media ends an episode as a tool error; ``ShapeQuest`` rows pack.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from relax.agents import (
    ChatFormatError,
    Env,
    EpisodeLimits,
    Sampler,
    Step,
    Trajectory,
    model_spans,
    run_episode,
)
from relax.agents.envs import SHAPE_QUEST_LETTERS, GuessNumber, ShapeQuest, shape_quest_tasks
from relax.config import ClusterConfig
from relax.engines import HFEngine, SamplingParams
from relax.media import PALETTE, draw_shapes, media_limits, mm_from_wire, moving_square, tones
from relax.media import placeholder_ids as media_placeholder_ids
from relax.models import MediaSpec, load_policy, stop_token_ids
from relax.roles._episodes import env_rows
from relax.training import forward_logprobs, pack_batch
from relax.transport import dumps, loads
from tests.models.helpers import OMNI, omni_dir_fixture, processor_fixture  # noqa: F401

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def reference(omni_dir: Path) -> torch.nn.Module:
    """An independent copy of the weights: the trainer's side of the comparison."""
    return load_policy(omni_dir)[0].eval()


@pytest.fixture
def engine(omni_dir: Path) -> HFEngine:
    return HFEngine.from_pretrained(omni_dir, max_batch_size=16)


class Recording(Sampler):
    """The real sampler, keeping every call's prompt, media and reply."""

    def __init__(self, engine: HFEngine) -> None:
        super().__init__(engine)
        self.log: list[dict[str, Any]] = []

    async def generate(self, prompt: Any, params: SamplingParams, **kwargs: Any) -> Any:
        gens = await super().generate(prompt, params, **kwargs)
        self.log.append(
            {
                "prompt": list(prompt),
                "media": kwargs.get("mm_inputs"),
                "ids": gens[0].response_ids,
                "logprobs": gens[0].logprobs,
            }
        )
        return gens


class Scripted(Env):
    """Opens with ``opening``; answers reply ``k`` with ``observations[k]``; done after the
    last one is answered."""

    def __init__(self, opening: Any, observations: list[Any]) -> None:
        self.opening, self.observations, self.k = opening, observations, 0

    async def reset(self, task: dict[str, Any]) -> Any:
        return self.opening

    async def step(self, action: str) -> Step:
        if self.k == len(self.observations):
            return Step(None, 1.0, True, {"success": True})
        self.k += 1
        return Step(self.observations[self.k - 1], 0.0, False)


def _image(seed: int, size: int) -> Any:
    return draw_shapes(seed, size=size)[0].numpy()


def _audio(seed: int, seconds: float) -> dict[str, Any]:
    return {"array": tones(seed, seconds=seconds)[0].numpy(), "sampling_rate": 16_000}


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


SCRIPTS: dict[str, tuple[Any, list[Any]]] = {
    # The case: a text question, the picture as the first observation.
    "image": (
        [{"role": "user", "content": "What colour?"}],
        [_user({"type": "image", "image": _image(0, 96)}, _text("This one."))],
    ),
    # Media everywhere: an image opening; then two images and audio; then a text turn; then
    # video and a shorter audio clip (audio frames padded, video seconds concatenated).
    "mixed": (
        _user({"type": "image", "image": _image(1, 56)}, _text("Look.")),
        [
            _user(
                {"type": "image", "image": _image(2, 96)},
                {"type": "audio", "audio": _audio(0, 1.0)},
                {"type": "image", "image": _image(3, 56)},
            ),
            "plain text",
            _user(
                _text("Now:"),
                {"type": "video", "video": moving_square(0)[0].numpy(), "fps": 2.0},
                {"type": "audio", "audio": _audio(1, 0.4)},
            ),
        ],
    ),
}
ITEMS = {"image": {"image": 1}, "mixed": {"image": 3, "audio": 2, "video": 1}}


def _limits() -> EpisodeLimits:
    return EpisodeLimits(max_turns=6, max_tokens=1024, max_reply_tokens=6, observation_role="user")


def _sampling(engine: HFEngine, seed: int = 3) -> SamplingParams:
    # The episode's limits cap every reply (``max_reply_tokens``, the token budget).
    stops = stop_token_ids(engine.tokenizer)
    return SamplingParams(max_new_tokens=1024, stop_token_ids=stops, seed=seed)


def _row(traj: Trajectory, group: str = "g") -> dict[str, Any]:
    """The row as the trainer gets it: through the wire format and back."""
    columns = loads(dumps(traj.columns()))
    columns["mm_inputs"] = mm_from_wire(columns.get("mm_inputs")) or None
    return {**columns, "group": group}


def _placeholders(traj: Trajectory, model: Any, processor: Any) -> dict[str, int]:
    """Placeholder tokens by kind in the whole sequence."""
    ids = torch.tensor(traj.ids)
    config = model.config
    tokens = {
        "image": config.image_token_id,
        "video": config.video_token_id,
        "audio": config.audio_token_id,
    }
    assert set(tokens.values()) == media_placeholder_ids(processor)
    return {kind: int((ids == token).sum()) for kind, token in tokens.items()}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
async def test_media_observations_row_reproduces_the_replies(
    script: str, engine: HFEngine, processor: Any, reference: torch.nn.Module
) -> None:
    opening, observations = SCRIPTS[script]
    sampler = Recording(engine)
    try:
        traj = await run_episode(
            Scripted(opening, observations),
            {"id": script},
            sampler,
            engine.tokenizer,
            _limits(),
            _sampling(engine),
            processor=processor,
        )
    finally:
        await sampler.aclose()
    assert traj.end == "done", traj.reason
    assert traj.turns == len(observations) + 1
    mm = traj.mm_inputs
    assert mm is not None

    # Exactly the placeholders of the accumulated media, item by item.
    items = ITEMS[script]
    merge = reference.config.vision_config.spatial_merge_size**2
    found = _placeholders(traj, reference, processor)
    for kind in ("image", "video"):
        grid = mm.get(f"{kind}_grid_thw")
        assert (0 if grid is None else grid.shape[0]) == items.get(kind, 0)
        assert found[kind] == (0 if grid is None else int(grid.prod(-1).sum()) // merge)
    spec = MediaSpec.from_model(reference)
    assert spec is not None
    if "audio" in items:
        mask = mm["feature_attention_mask"]
        assert mask.shape[0] == mm["input_features"].shape[0] == items["audio"]
        assert spec.audio_tokens is not None
        assert found["audio"] == int(spec.audio_tokens(mask.sum(-1)).sum())
        assert mm["video_second_per_grid"].shape[0] == mm["video_grid_thw"].shape[0]
    else:
        assert found["audio"] == 0
    spec.check(0, traj.ids, mm)  # the engine's own check: runs of placeholders fit the items

    # Token-exact: every call was prompted with the trajectory so far and the media so far;
    # the row's model spans are the sampled ids with their log-probs.
    log = sampler.log
    assert len(log) == traj.turns
    for call, record in zip(traj.calls, log, strict=True):
        assert record["prompt"] == traj.ids[: call["prompt_tokens"]]
        assert record["ids"] == call["ids"]
        if record["media"] is None:  # a text-only prefix (the first call of "image")
            assert (
                sum(_placeholders(Trajectory(record["prompt"]), reference, processor).values()) == 0
            )
        else:  # the media sent with it fill exactly its placeholders
            spec.check(0, record["prompt"], record["media"])
    assert model_spans(traj.loss_mask, traj.response_ids) == traj.generated_ids()
    sampled = iter(lp for record in log for lp in record["logprobs"])
    assert traj.logprobs == [next(sampled) if m else 0.0 for m in traj.loss_mask]
    # Observations, their placeholders included, are masked out.
    banned = media_placeholder_ids(processor)
    assert sum(traj.loss_mask) == sum(len(c["ids"]) for c in traj.calls)
    in_response = [t for t in traj.response_ids if t in banned]
    assert in_response and not any(
        m for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if t in banned
    )

    # The trainer's forward of the row (wire round trip, no position ids, suppressed ids
    # masked) gives back the sampler's log-probs of every reply.
    row = _row(traj)
    assert set(row["mm_inputs"]) == set(mm)
    for key, tensor in mm.items():
        assert torch.equal(row["mm_inputs"][key], tensor)
    batch = pack_batch([row], pad_id=engine.tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs, _ = forward_logprobs(reference, batch)
    on = batch.mask > 0
    assert int(on.sum()) == sum(traj.loss_mask)
    diff = (logprobs[on] - batch.rollout_logprobs[on]).abs().max()
    assert diff < 1e-4, diff


async def test_media_of_turns_merge_as_if_processed_together(
    engine: HFEngine, processor: Any
) -> None:
    """The episode's accumulated tensors are the ones the processor gives for the whole
    conversation at once (each key concatenated in order of appearance)."""
    from relax.media import process_prompt

    opening, observations = SCRIPTS["mixed"]
    sampler = Sampler(engine)
    try:
        traj = await run_episode(
            Scripted(opening, observations),
            {"id": "merge"},
            sampler,
            engine.tokenizer,
            _limits(),
            _sampling(engine),
            processor=processor,
        )
    finally:
        await sampler.aclose()
    assert traj.end == "done" and traj.mm_inputs is not None
    media_turns = [o for o in observations if not isinstance(o, str)]
    whole = process_prompt(
        processor,
        [*opening, *(m for turn in media_turns for m in turn)],
        media_limits(),
        item="whole",
    )
    assert set(whole.mm_inputs) == set(traj.mm_inputs)
    for key, tensor in whole.mm_inputs.items():
        assert torch.equal(traj.mm_inputs[key], tensor), key


async def test_text_episode_is_unchanged_by_a_processor(engine: HFEngine, processor: Any) -> None:
    """A text episode on a multimodal model: the same trajectory with or without the
    processor, and no media column."""
    trajs = []
    for proc in (None, processor):
        sampler = Sampler(engine)
        try:
            trajs.append(
                await run_episode(
                    GuessNumber(),
                    {"id": "g", "prompt": "Guess my number (0-9).", "answer": "7"},
                    sampler,
                    engine.tokenizer,
                    EpisodeLimits(max_turns=3, max_reply_tokens=4, max_tokens=128),
                    _sampling(engine, seed=11),
                    processor=proc,
                )
            )
        finally:
            await sampler.aclose()
    plain, with_processor = trajs
    assert plain.columns() == with_processor.columns()
    assert "mm_inputs" not in plain.columns() and plain.mm_inputs is None


async def test_bad_media_ends_the_episode_as_a_tool_error(engine: HFEngine, processor: Any) -> None:
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(_image(4, 56)).save(png, format="PNG")
    corrupt = png.getvalue()[: len(png.getvalue()) // 2]
    cases = {
        "observation": Scripted(
            [{"role": "user", "content": "hi"}],
            [_user({"type": "image", "image": corrupt}, _text("?"))],
        ),
        "reset": Scripted(_user({"type": "image", "image": corrupt}), []),
        "spelled": Scripted([{"role": "user", "content": "hi"}], ["see <|IMAGE|> here"]),
    }
    sampler = Sampler(engine)
    try:
        for name, env in cases.items():
            traj = await run_episode(
                env,
                {"id": name, "prompt": "hi"},
                sampler,
                engine.tokenizer,
                _limits(),
                _sampling(engine),
                processor=processor,
            )
            assert traj.end == "tool_error", name
            assert traj.mm_inputs is None and "mm_inputs" not in traj.columns()
            if name == "spelled":
                assert "placeholder" in traj.reason
            else:
                assert "image" in traj.reason and name in traj.reason, traj.reason
            # What the episode has is still a row the engine and trainer accept.
            spec = MediaSpec.from_model(engine.model)
            assert spec is not None
            spec.check(0, traj.ids, None)
        # Media without a processor is a configuration error, raised.
        with pytest.raises(ChatFormatError, match="processor"):
            await run_episode(
                Scripted(*SCRIPTS["image"]),
                {"id": "x"},
                sampler,
                engine.tokenizer,
                _limits(),
                _sampling(engine),
            )
    finally:
        await sampler.aclose()


async def test_text_and_media_requests_share_a_batch(engine: HFEngine, processor: Any) -> None:
    """Concurrent episodes, some with media and some without, batch in one engine call and
    get the replies they get alone."""

    def envs() -> list[tuple[Env, dict[str, Any]]]:
        tasks = shape_quest_tasks(1)
        return [
            (ShapeQuest(), next(tasks)),
            (GuessNumber(), {"id": "g", "prompt": "Guess my number (0-9).", "answer": "3"}),
            (ShapeQuest(), next(tasks)),
        ]

    async def play(pairs: list[tuple[Env, dict[str, Any]]], sampler: Sampler) -> list[Any]:
        return await asyncio.gather(
            *(
                run_episode(
                    env,
                    task,
                    sampler,
                    engine.tokenizer,
                    EpisodeLimits(max_turns=2, max_reply_tokens=4, max_tokens=256),
                    _sampling(engine, seed=20 + i),
                    processor=processor,
                )
                for i, (env, task) in enumerate(pairs)
            )
        )

    together = Sampler(engine)
    try:
        batched = await play(envs(), together)
    finally:
        await together.aclose()
    assert together.stats["largest_batch"] == 3
    assert batched[0].end == batched[2].end == "done"
    assert batched[0].mm_inputs is not None and batched[1].mm_inputs is None
    alone = Sampler(engine)
    try:
        (solo,) = await play(envs()[:1], alone)
    finally:
        await alone.aclose()
    assert solo.generated_ids() == batched[0].generated_ids()


def test_shape_quest_shows_the_colour_it_asks_for() -> None:
    tasks = shape_quest_tasks(0)
    seen = set()
    for _ in range(12):
        task = next(tasks)
        env = ShapeQuest()
        opening = asyncio.run(env.reset(task))
        assert not any(isinstance(m["content"], list) for m in opening)  # no picture yet
        step = asyncio.run(env.step("show me"))
        assert not step.done and isinstance(step.observation, list)
        image = step.observation[0]["content"][0]["image"]
        colours = {tuple(int(c) for c in px) for px in image.reshape(-1, 3)} - {(255, 255, 255)}
        assert colours == {PALETTE[SHAPE_QUEST_LETTERS[task["answer"]]]}
        # Replays draw the same picture.
        again = ShapeQuest()
        asyncio.run(again.reset(task))
        assert (asyncio.run(again.step("x")).observation[0]["content"][0]["image"] == image).all()
        final = asyncio.run(env.step(f" {task['answer'].upper()}, surely"))
        assert final.done and final.reward == 1.0 and final.info["success"] is True
        seen.add(task["answer"])
    assert seen == set(SHAPE_QUEST_LETTERS)
    wrong = ShapeQuest()
    task = next(tasks)
    asyncio.run(wrong.reset(task))
    asyncio.run(wrong.step(""))
    other = next(letter for letter in SHAPE_QUEST_LETTERS if letter != task["answer"])
    assert asyncio.run(wrong.step(other)).info["success"] is False


async def test_shape_quest_rows_pack(
    engine: HFEngine, processor: Any, reference: torch.nn.Module
) -> None:
    """e2e-lite: ShapeQuest episodes played the way the rollout role plays them
    (``env_rows``) become rows that ``pack_batch`` takes and the trainer's forward scores as
    the sampler did."""
    cfg = ClusterConfig.model_validate(
        {
            "model": {"init": OMNI},
            "data": {"generator": "relax.agents.envs:shape_quest_tasks", "n_samples_per_prompt": 2},
            "rollout": {
                "max_new_tokens": 4,
                "seed": 5,
                "agent": {
                    "kind": "env",
                    "env": "relax.agents.envs:ShapeQuest",
                    "max_turns": 2,
                    "max_tokens": 200,
                },
            },
        }
    )
    tasks = shape_quest_tasks(2)
    prompts = []
    for _ in range(3):
        task = next(tasks)
        prompts.append(
            {"uid": task["id"], "columns": {"text": task["prompt"], "answer": task["answer"]}}
        )
    sampler = Sampler(engine)
    try:
        rows, trajs = await env_rows(
            cfg, sampler, engine.tokenizer, prompts, stop_token_ids(engine.tokenizer), processor
        )
    finally:
        await sampler.aclose()
    assert len(rows) == 6
    for row, traj in zip(rows, trajs, strict=True):
        assert traj.end == "done" and traj.turns == 2, traj.reason
        assert row["columns"]["success"] in (0.0, 1.0)
        assert row["columns"]["mm_inputs"]["image_grid_thw"].shape[0] == 1
    packed = [
        {**loads(dumps(row["columns"])), "group": row["group"]} for row in rows
    ]  # as the trainer reads them off the bus
    for row in packed:
        row["mm_inputs"] = mm_from_wire(row["mm_inputs"])
    batch = pack_batch(packed, pad_id=engine.tokenizer.pad_token_id)
    assert batch.mm_inputs is not None and len(batch.mm_inputs) == 6
    with torch.no_grad():
        logprobs, _ = forward_logprobs(reference, batch)
    on = batch.mask > 0
    assert (logprobs[on] - batch.rollout_logprobs[on]).abs().max() < 1e-4


@pytest.mark.slow
async def test_shape_quest_cluster_trains_on_its_media_rows(tmp_path: Path) -> None:
    """The whole run: the rollout role loads the processor, episodes show their picture in the
    second turn, and the trainer's log-probs of the replies match the sampler's."""
    from relax import cluster
    from relax.config import parse_config
    from tests.e2e.audit import check_exactly_once, read_metrics, replay_samples_bus
    from tests.tiny import tiny_toml

    model = "[model.init]\n" + "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in OMNI.items())
    cfg = parse_config(
        tiny_toml(
            "shape-quest",
            steps=3,
            max_new_tokens=3,
            model=model,
            data='generator = "relax.agents.envs:shape_quest_tasks"',
            extra='[rollout.agent]\nkind = "env"\nenv = "relax.agents.envs:ShapeQuest"\n'
            "max_turns = 2\nmax_tokens = 200\n",
        )
    )
    run = tmp_path / "run"
    layout = cluster.prepare(cfg, run)
    async with cluster.build_tree(cfg, layout) as tree:
        await tree.wait()
        snap = await tree.snapshot()
    assert all(c["restart_count"] == 0 for c in snap["children"])
    ledger = replay_samples_bus(run)
    check_exactly_once(ledger)
    assert ledger.trained
    for uid in ledger.trained:
        cols = ledger.rows[uid]["columns"]
        assert cols["episode_end"] == "done" and cols["turns"] == 2
        assert mm_from_wire(cols["mm_inputs"])["image_grid_thw"].shape[0] == 1
    steps = [s for s in read_metrics(run) if s["applied"]]
    assert steps and all("success_rate" in s and s["mismatch_max"] < 1e-4 for s in steps)
