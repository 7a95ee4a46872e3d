"""Omni-modal runs end to end on a tiny Qwen2.5-Omni thinker built on the spot: images, audio,
video and text in one run, the trainer scoring exactly the processed inputs the rollout
generated with, gradients reaching the vision and audio towers, bad media skipped per sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax import cluster
from relax.bus import SegmentLog
from relax.config import load_config, parse_config
from relax.media import mm_from_wire
from relax.transport import loads
from tests.e2e.audit import check_exactly_once, read_metrics, replay_samples_bus
from tests.tiny import tiny_toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

OMNI = """[model.init]
arch = "qwen2_5_omni"
hidden_size = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 128
vocab_size = 268
"""


OMNI_MOE = """[model.init]
arch = "qwen3_omni_moe"
hidden_size = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 128
moe_intermediate_size = 32
num_experts = 4
num_experts_per_tok = 2
vocab_size = 268
"""


def omni_cluster(
    name: str,
    generator: str,
    steps: int,
    extra: str = "",
    *,
    model: str = OMNI,
    trainer: str = "",
    staleness: int = 0,
) -> str:
    return tiny_toml(
        name,
        staleness=staleness,
        steps=steps,
        max_new_tokens=3,
        model=model,
        trainer=trainer,
        data=f'generator = "{generator}"\nmax_prompt_tokens = 512',
        # About half the random replies start with an ASCII character: rewards vary within
        # groups, so every step has a gradient to check.
        extra='[[reward.functions]]\nname = "half"\nkind = "regex"\npattern = "^[\\\\x00-\\\\x7f]"\n'
        + extra,
    )


def put_rows(run_dir: Path, bus: str) -> dict[str, dict]:
    """uid -> the row as first put on ``bus`` (replayed from its log)."""
    rows: dict[str, dict] = {}
    with SegmentLog(run_dir / bus / "bus-log") as log:
        for _, record in log.replay():
            op = loads(record)
            if op["op"] == "put":
                for row in op["rows"]:
                    rows.setdefault(row["uid"], row)
    return rows


def tower_weights(folder: Path, routers: bool = False) -> dict[str, torch.Tensor]:
    """The media towers' weights in ``folder`` (and, with ``routers``, the MoE routers')."""
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    parts = ("audio_tower", "visual", "mlp.gate.") if routers else ("audio_tower", "visual")
    return {k: v for k, v in weights.items() if any(p in k for p in parts)}


async def test_mixed_media_run_trains_on_the_inputs_it_generated_with(tmp_path) -> None:
    cfg = parse_config(omni_cluster("mixed", "relax.media.recipes:mixed", steps=4))
    layout = cluster.prepare(cfg, tmp_path / "run")
    async with cluster.build_tree(cfg, layout) as tree:
        await tree.wait()
        snap = await tree.snapshot()
    assert all(c["restart_count"] == 0 for c in snap["children"]), snap
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    prompts = put_rows(layout.run_dir, "prompts")
    kinds = set()
    for uid in ledger.trained:
        row = ledger.rows[uid]
        media = row["columns"].get("mm_inputs")
        prompt = prompts[row["group"]]["columns"]
        if media is None:
            assert "mm_inputs" not in prompt
            kinds.add("text")
            continue
        # Processed once by the dataset role; the sample row carries the very same tensors.
        sent, got = mm_from_wire(prompt["mm_inputs"]), mm_from_wire(media)
        assert sent.keys() == got.keys()
        for key in sent:
            assert torch.equal(sent[key], got[key]), key
        kinds.update(
            {"pixel_values": "image", "input_features": "audio", "pixel_values_videos": "video"}[k]
            for k in got
            if k in ("pixel_values", "input_features", "pixel_values_videos")
        )
    assert kinds == {"text", "image", "audio", "video"}, kinds  # one run, every modality
    steps = [s for s in read_metrics(layout.run_dir) if s["applied"]]
    assert len(steps) == 4
    # Staleness 0: the trainer scores every row under the weights that generated it, so its
    # log-probs equal the sampler's up to float noise — only if it saw the same pixels,
    # features, positions and masks (measured: 5e-7; pixels off by 0.05 give 1.4e-3).
    for s in steps:
        print(json.dumps({k: s[k] for k in ("mismatch_max", "mismatch_kl", "reward_mean")}))
        assert s["mismatch_max"] < 1e-4 and s["mismatch_kl"] < 1e-8, s
    # Gradients reached the towers: their weights moved.
    before = tower_weights(layout.model_dir)
    after = tower_weights(sorted((layout.run_dir / "checkpoints").glob("step-*"))[-1])
    assert before and before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("audio_tower" in k for k in moved) and any("visual" in k for k in moved), sorted(
        moved
    )


@pytest.mark.parametrize("staleness", [0, 1])
async def test_an_moe_thinker_trains_on_every_modality_with_routing_replay(
    tmp_path, staleness
) -> None:
    """A Qwen3-Omni-MoE thinker (every decoder layer four experts, top-2) through the omni path
    with R3: every trained row carries the routing its rollout recorded, one record per token
    of prompt (media placeholders included) and response; the trainer's forward replays it, and
    its towers and routers learn."""
    cfg = parse_config(
        omni_cluster(
            "omni-moe",
            "relax.media.recipes:mixed",
            steps=4,
            model=OMNI_MOE,
            trainer="routing_replay = true\nmoe_aux_loss_coef = 0.01",
            staleness=staleness,
        )
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    kinds = set()
    for uid in ledger.trained:
        cols = ledger.rows[uid]["columns"]
        tokens = len(cols["prompt_ids"]) + len(cols["response_ids"])
        routed = torch.tensor(cols["routed_experts"])
        assert tuple(routed.shape) == (tokens, 2, 2), uid
        assert (routed[-1] == 4).all() and (routed[:-1] < 4).all(), uid  # last: unrecorded
        media = cols.get("mm_inputs")
        kinds.update(mm_from_wire(media) if media is not None else ["text"])
    assert {"pixel_values", "input_features", "pixel_values_videos", "text"} <= kinds, kinds
    steps = [s for s in read_metrics(layout.run_dir) if s["applied"]]
    assert len(steps) == 4
    assert max(s["staleness_max"] for s in steps) <= staleness
    for s in steps:
        assert "router_disagreement" in s and s["moe_aux_loss"] > 0, s
    if staleness == 0:  # same weights, same inputs, the recorded routes: the sampler's logprobs
        assert all(s["mismatch_max"] < 1e-4 for s in steps), steps
    before = tower_weights(layout.model_dir, routers=True)
    after = tower_weights(sorted((layout.run_dir / "checkpoints").glob("step-*"))[-1], True)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    for part in ("audio_tower", "visual", "mlp.gate"):
        assert any(part in k for k in moved), (part, sorted(moved))


@pytest.mark.parametrize(
    ("recipe", "key", "tower"),
    [
        ("omni_shapes", "pixel_values", "visual"),
        ("omni_audio", "input_features", "audio_tower"),
        ("omni_video", "pixel_values_videos", "visual"),
    ],
)
async def test_each_modality_recipe_trains_on_what_it_generated_with(
    tmp_path, recipe, key, tower
) -> None:
    """The image, audio and video recipes of examples/, two steps each at staleness 0: every
    row carries its modality's inputs, the trainer's log-probs equal the sampler's, and that
    modality's tower learns. (Only the image recipe learns its task in minutes; see each
    recipe's header.)"""
    cfg = load_config(
        EXAMPLES / recipe / "cluster.toml",
        # An entropy bonus: a gradient through the towers even in steps where no sample of a
        # random model earns a reward (all-zero advantages).
        overrides=[
            "trainer.steps=2",
            "staleness=0",
            "algorithm.entropy_coef=0.01",
            'logging.level="warning"',
        ],
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    assert ledger.trained
    for uid in ledger.trained:
        assert key in mm_from_wire(ledger.rows[uid]["columns"]["mm_inputs"])
    steps = [s for s in read_metrics(layout.run_dir) if s["applied"]]
    assert len(steps) == 2
    assert all(s["mismatch_max"] < 1e-4 for s in steps), steps
    before = tower_weights(layout.model_dir)
    after = tower_weights(sorted((layout.run_dir / "checkpoints").glob("step-*"))[-1])
    assert any(not torch.equal(before[k], after[k]) for k in before if tower in k)


async def test_bad_media_are_skipped_per_sample_and_the_run_goes_on(tmp_path) -> None:
    cfg = parse_config(omni_cluster("bad", "relax.media.recipes:bad_media", steps=3))
    layout = await cluster.run(cfg, tmp_path / "run")  # raises if the tree gave up
    assert len([s for s in read_metrics(layout.run_dir) if s["applied"]]) == 3
    lines = (layout.run_dir / "logs" / "dataset.jsonl").read_text().splitlines()
    skipped = [
        e for e in map(json.loads, lines) if e.get("event") == "prompt with bad media skipped"
    ]
    reasons = " | ".join(e["reason"] for e in skipped)
    # Each kind of fault was met and named, per sample; the dataset role never restarted.
    for words in ("file does not exist", "44101"):
        assert words in reasons, reasons
    assert all(e["id"] for e in skipped)
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    bad = {e["id"] for e in skipped}
    assert not bad & {ledger.rows[u]["group"] for u in ledger.rows}  # none reached the bus


@pytest.mark.timeout(300)
async def test_vision_recipe_learns_to_read_the_colour(tmp_path) -> None:
    """examples/omni_shapes: the reward is 1 for the shape's colour letter. Guessing among the
    three letters gets 1/3; a last quarter well above it means the policy reads the pixels."""
    cfg = load_config(
        EXAMPLES / "omni_shapes" / "cluster.toml",
        # Staleness 0 is the synchronous loop: the same run on every machine.
        overrides=["staleness=0", 'logging.level="warning"'],
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    rewards = [s["reward_mean"] for s in read_metrics(layout.run_dir) if s["applied"]]
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    print(json.dumps({"first": first, "last": last}))
    # Measured (300 steps, ~60 s): staleness 0 (this test) 0.051 -> 0.667; the example's
    # staleness 1, seeds 0-2: 0.02-0.04 -> 0.64-0.68.
    assert first < 0.1
    assert last > 0.5


async def test_a_sample_over_the_token_limit_is_dropped_with_its_group_not_trained(
    tmp_path,
) -> None:
    """Media placeholders count: audio prompts (75 tokens with their 25 audio tokens) exceed
    `max_sample_tokens = 70`, so their groups are dropped as "oversized"; the rest trains."""
    cfg = parse_config(
        omni_cluster("budget", "relax.media.recipes:mixed", steps=3),
        overrides=["trainer.max_sample_tokens=70"],
    )
    layout = await cluster.run(cfg, tmp_path / "run")
    assert len([s for s in read_metrics(layout.run_dir) if s["applied"]]) == 3
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    oversized = ledger.dropped_for("oversized")
    assert oversized and all("-tone" in ledger.rows[u]["group"] for u in oversized)
    for uid in ledger.trained:
        cols = ledger.rows[uid]["columns"]
        assert len(cols["prompt_ids"]) + len(cols["response_ids"]) <= 70
