"""Environment episodes: token-in/token-out across turns, masks, budgets, and failing tools."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from relax.agents import (
    Env,
    EpisodeLimits,
    Sampler,
    Step,
    model_spans,
    run_episode,
)
from relax.agents.envs import Calculator, GuessNumber, evaluate
from relax.config import ModelInitConfig
from relax.engines import HFEngine, SamplingParams
from relax.models import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model, stop_token_ids
from relax.training import pack_batch

pytestmark = pytest.mark.anyio

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 261}


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(ModelInitConfig(**TINY, seed=0), tmp_path_factory.mktemp("byte"))


@pytest.fixture
def engine(byte_dir: Path) -> HFEngine:
    return HFEngine.from_pretrained(byte_dir)


def bpe_engine() -> HFEngine:
    """A real BPE tokenizer (merges!) and a model over its vocabulary: sampled id sequences
    are often not the tokenizer's canonical split of their own text."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["higher lower guess my number say a number from zero to nine"] * 50
    text += [f"{i} {i * 7} tool assistant user" for i in range(200)]
    core.train_from_iterator(text, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
    )
    model = Qwen2ForCausalLM(config)
    return HFEngine(model, pad_token_id=tok.pad_token_id, tokenizer=tok)


class Recording(Sampler):
    """The real sampler, keeping every call's prompt and replies for the assertions."""

    def __init__(self, engine: HFEngine) -> None:
        super().__init__(engine)
        self.log: list[tuple[list[int], list[int], list[float]]] = []

    async def generate(self, prompt: Any, params: SamplingParams, **kwargs: Any) -> Any:
        gens = await super().generate(prompt, params, **kwargs)
        self.log.append((list(prompt), gens[0].response_ids, gens[0].logprobs))
        return gens


def sampling(engine: HFEngine, seed: int = 1) -> SamplingParams:
    # The episode's limits cap every reply (``max_reply_tokens``, the token budget).
    stops = stop_token_ids(engine.tokenizer)
    return SamplingParams(max_new_tokens=1024, stop_token_ids=stops, seed=seed)


def check_token_exact(traj: Any, log: list[tuple[list[int], list[int], list[float]]]) -> None:
    """What is trained on is what was generated: each call was prompted with the trajectory so
    far, and the row's model spans are the replies, in order, with their logprobs."""
    assert len(log) == traj.turns
    for k, (prompt, reply, _) in enumerate(log):
        assert prompt == traj.ids[: len(prompt)], f"call {k} was not prompted with the trajectory"
        assert traj.ids[len(prompt) : len(prompt) + len(reply)] == reply
    spans = model_spans(traj.loss_mask, traj.response_ids)
    assert [s for s in spans if s] == [r for _, r, _ in log if r]
    masked = [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m]
    assert masked == [x for _, _, lps in log for x in lps]


async def test_guess_number_episode_is_token_exact_and_masked(engine: HFEngine) -> None:
    sampler = Recording(engine)
    task = {"id": "t0", "prompt": "Guess my number (0-9).", "answer": "7"}
    limits = EpisodeLimits(max_turns=3, max_reply_tokens=6, max_tokens=400)
    traj = await run_episode(
        GuessNumber(), task, sampler, engine.tokenizer, limits, sampling(engine)
    )
    assert traj.end == "max_turns" and traj.turns == 3
    check_token_exact(traj, sampler.log)
    # Observations are there, masked: the tool turn text sits in the unmasked part.
    observed = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if not m]
    assert "<|im_start|>tool\nSay a number from 0 to 9." in engine.tokenizer.decode(observed)
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    # The row trains with exactly these masks.
    row = {**traj.columns(), "group": "g"}
    batch = pack_batch([row], pad_id=256)
    p = len(traj.prompt_ids)
    assert batch.mask[0, p - 1 : p - 1 + len(traj.loss_mask)].tolist() == traj.loss_mask
    assert batch.mask.sum().item() == sum(traj.loss_mask)


async def test_episode_replays_with_its_seed(engine: HFEngine) -> None:
    task = {"id": "t0", "prompt": "Guess my number (0-9).", "answer": "3"}
    limits = EpisodeLimits(max_turns=2, max_reply_tokens=4)
    a = await run_episode(
        GuessNumber(), task, Sampler(engine), engine.tokenizer, limits, sampling(engine, 5)
    )
    b = await run_episode(
        GuessNumber(), task, Sampler(engine), engine.tokenizer, limits, sampling(engine, 5)
    )
    assert a.ids == b.ids and a.logprobs == b.logprobs


async def test_bpe_tokenizer_replies_are_not_retokenised() -> None:
    """With merges, re-tokenising a sampled reply gives other ids (the drift this avoids);
    the trajectory still holds exactly the sampled ones."""
    engine = bpe_engine()
    drifted = 0
    for seed in range(6):
        sampler = Recording(engine)
        task = {"id": f"t{seed}", "prompt": "Guess my number (0-9).", "answer": "4"}
        limits = EpisodeLimits(max_turns=3, max_reply_tokens=8, max_tokens=600)
        traj = await run_episode(
            GuessNumber(), task, sampler, engine.tokenizer, limits, sampling(engine, seed)
        )
        check_token_exact(traj, sampler.log)
        for _, reply, _ in sampler.log:
            text = engine.tokenizer.decode(reply, skip_special_tokens=False)
            if engine.tokenizer.encode(text, add_special_tokens=False) != reply:
                drifted += 1
    assert drifted > 0, "no reply would have drifted: the test would not catch re-tokenising"


class Scripted(Env):
    """Fails (raises or hangs) on the given turn."""

    def __init__(self, *, fail_on: int, how: str) -> None:
        self.turn, self.fail_on, self.how = 0, fail_on, how
        self.closed = False

    async def reset(self, task: dict[str, Any]) -> str:
        return "Play."

    async def step(self, action: str) -> Step:
        self.turn += 1
        if self.turn == self.fail_on:
            if self.how == "raise":
                raise ZeroDivisionError("the tool divided by zero")
            await asyncio.Event().wait()  # hangs
        return Step("go on", reward=0.5)

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("how", ["raise", "hang"])
async def test_failing_tool_ends_the_episode_with_a_reason(engine: HFEngine, how: str) -> None:
    env = Scripted(fail_on=2, how=how)
    limits = EpisodeLimits(max_turns=5, max_reply_tokens=3, tool_timeout=0.3, error_reward=-1.0)
    traj = await run_episode(env, {"id": "x"}, Sampler(engine), engine.tokenizer, limits)
    assert traj.turns == 2 and env.closed
    assert traj.reward == -1.0
    if how == "raise":
        assert (
            traj.end == "tool_error"
            and "ZeroDivisionError: the tool divided by zero" in traj.reason
        )
    else:
        assert traj.end == "tool_timeout" and "0.3 s" in traj.reason
    assert traj.columns()["episode_reason"] == traj.reason


async def test_token_budget_ends_before_an_observation_without_room(engine: HFEngine) -> None:
    env = Scripted(fail_on=99, how="raise")
    limits = EpisodeLimits(max_turns=50, max_reply_tokens=4, max_tokens=40)
    traj = await run_episode(env, {"id": "x"}, Sampler(engine), engine.tokenizer, limits)
    assert traj.end == "token_budget"
    assert len(traj.response_ids) <= 40
    assert traj.reward == pytest.approx(0.5 * traj.turns)


async def test_calculator_tool_call_round_trip(engine: HFEngine) -> None:
    """The tool's answer comes back as a masked tool turn; a bad expression is a tool error."""
    env = Calculator()
    await env.reset({"prompt": "What is 6*7?", "answer": "42"})
    step = await env.step(
        '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
    )
    assert (step.observation, step.done) == ("42", False)
    final = await env.step("42")
    assert final.done and final.reward == 1.0 and final.info == {"success": True}
    with pytest.raises(ValueError, match="not arithmetic"):
        evaluate("__import__('os')")
    with pytest.raises(ValueError):
        await env.step(
            '<tool_call>{"name": "calc", "arguments": {"expression": "6**"}}</tool_call>'
        )


async def test_an_moe_episode_s_row_carries_each_token_s_routing(tmp_path: Path) -> None:
    """Across turns and observations (R3): one record per token of the whole row, each the
    routing of the call that processed it first, and all of it what one teacher-forced pass
    of the row routes (one weights version); tokens after the last reply are not recorded."""
    from relax.models import RoutingRecorder

    folder = build_tiny_model(ModelInitConfig(**TINY, arch="qwen3_moe", seed=2), tmp_path)
    moe = HFEngine.from_pretrained(folder)
    task = {"id": "t0", "prompt": "Guess my number (0-9).", "answer": "7"}
    limits = EpisodeLimits(max_turns=3, max_reply_tokens=6, max_tokens=400)
    traj = await run_episode(
        GuessNumber(), task, Sampler(moe), moe.tokenizer, limits, sampling(moe)
    )
    assert traj.turns == 3
    row = traj.columns()
    ids = row["prompt_ids"] + row["response_ids"]
    routed = row["routed_experts"]
    assert tuple(routed.shape) == (len(ids), 2, 2)
    recorded = (routed < 8).all(-1).all(-1)
    last_reply_end = len(row["prompt_ids"]) + max(
        i + 1 for i, m in enumerate(row["loss_mask"]) if m
    )
    assert recorded[: last_reply_end - 1].all() and not recorded[last_reply_end - 1 :].any()
    with RoutingRecorder(moe.model) as rec, torch.no_grad():
        moe.model(input_ids=torch.tensor([ids]))
    forced = rec.pass_ids(0).permute(1, 0, 2)[: last_reply_end - 1].sort(-1).values
    assert torch.equal(forced, routed[: last_reply_end - 1].long().sort(-1).values)
    # The row is one the bus and the trainer take.
    batch = pack_batch([{**row, "group": "g"}], pad_id=256)
    assert batch.routed_experts is not None and batch.routed_experts.shape[1] == len(ids)


def test_a_trajectory_keeps_routing_only_while_every_reply_has_it() -> None:
    from relax.agents._trajectory import Trajectory

    def record(n: int, fill: int) -> torch.Tensor:
        out = torch.full((n, 1, 2), fill, dtype=torch.uint8)
        out[-1] = 8  # the call's last token is never fed back
        return out

    traj = Trajectory([1, 2])
    traj.add_reply([3, 4], [-1.0, -1.0], 0, record(4, 1))
    traj.add_observation([5])
    traj.add_reply([6], [-1.0], 0, record(6, 2))  # prefilled 1..5, its last reply token 4 too
    assert traj.routing()[:, 0, 0].tolist() == [1, 1, 1, 2, 2, 8]
    traj.add_observation([7, 8])
    assert traj.routing()[:, 0, 0].tolist() == [1, 1, 1, 2, 2, 8, 8, 8]  # not recorded
    traj.add_reply([9], [-1.0], 0, None)  # a reply without a record: the row has none
    assert traj.routing() is None and "routed_experts" not in traj.columns()
