"""`[rollout] schedule = "shortest_first"`: groups reach the bus as they finish, shortest first,
and a replica orders its batches by the lengths it observed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relax.actors import ChildSpec, InProc
from relax.bus import BusClient
from relax.bus._log import SegmentLog
from relax.config import parse_config
from relax.engines import HFEngine
from relax.errors import ConfigError
from relax.roles._lengths import LengthBook
from relax.roles._rollout import RolloutRole, generate_groups
from relax.transport import loads
from tests.polling import wait_until
from tests.roles.helpers import bus_spec, config, prompts_spec, start, tiny_model
from tests.tiny import spread_lengths, tiny_toml

pytestmark = pytest.mark.anyio

PROMPTS = [[257, 40 + i, 50 + i, 60 + 2 * i] for i in range(8)]


def prompt_rows(prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [
        {
            "uid": f"p{i}",
            "group": f"p{i}",
            "version": 0,
            "columns": {"prompt_ids": p, "answer": "4"},
        }
        for i, p in enumerate(prompts)
    ]


def test_the_book_orders_by_observed_length_and_forgets_the_oldest() -> None:
    book = LengthBook(capacity=3)
    rows = prompt_rows(PROMPTS[:4])
    assert book.order(rows) == rows  # nothing observed: the order stays
    book.observe(PROMPTS[0], [9, 11])  # 10
    book.observe(PROMPTS[1], [2, 2])  # 2
    book.observe(PROMPTS[2], [6])  # 6
    # p3 is unseen: it counts as the mean (6), after p2 (a stable sort keeps p2 first).
    assert [r["uid"] for r in book.order(rows)] == ["p1", "p2", "p3", "p0"]
    assert book.statistics()["reordered_batches"] == 1
    book.observe(PROMPTS[3], [1])  # a fourth prompt: the least recently seen (p0) goes
    assert book.expected(PROMPTS[0]) is None and book.expected(PROMPTS[3]) == 1
    book.observe(PROMPTS[1], [4, 6])  # seen again: its newest group counts
    stats = book.statistics()
    assert book.expected(PROMPTS[1]) == 5 and stats["prompts"] == 3
    assert stats["mean_length"] == pytest.approx((6 + 1 + 5) / 3)


def test_shortest_first_is_for_single_replies() -> None:
    text = tiny_toml("sched", rollout='schedule = "shortest_first"')
    assert parse_config(text).rollout.schedule == "shortest_first"
    agent = '[rollout.agent]\nkind = "env"\nenv = "relax.agents.envs:ShapeQuest"\n'
    with pytest.raises(ConfigError, match=r"rollout\.schedule.*single-reply"):
        parse_config(tiny_toml("sched", rollout='schedule = "shortest_first"', extra=agent))


async def test_groups_come_out_as_their_last_sample_ends_with_stop_strings_cut(
    tmp_path: Path,
) -> None:
    # A widely spread policy: groups end at 4-8 different lengths for every seed 0-7 (at the
    # default scale most groups ran to the cap, and a spread hung on the seed's luck).
    model = spread_lengths(tiny_model(tmp_path), scale=60)
    engine = HFEngine.from_pretrained(model, tokenizer=model)
    cfg = parse_config(tiny_toml("groups", max_new_tokens=16, rollout='stop = ["a"]\nseed = 3'))
    heard: list[tuple[int, list[Any]]] = []
    stops = [engine.tokenizer.eos_token_id]
    gens = await generate_groups(
        engine, cfg, prompt_rows(PROMPTS), stops, None, lambda i, g: heard.append((i, g))
    )
    n = cfg.data.n_samples_per_prompt
    assert sorted(i for i, _ in heard) == list(range(len(PROMPTS)))
    for i, group in heard:
        assert group == gens[i * n : i * n + n]  # as returned, stop strings cut
    assert len({max(len(g.response_ids) for g in group) for _, group in heard}) > 2


async def test_a_rollout_puts_each_group_as_it_finishes_shortest_first(tmp_path: Path) -> None:
    prompts_url = "inproc://schedule-prompts"
    prompts = prompts_spec(prompts_url, tmp_path / "prompts", prompt_rows(PROMPTS))
    samples, samples_url = bus_spec(["reward", "train"], tmp_path)
    extra = '[rollout]\nmax_new_tokens = 16\nbatch_size = 8\nschedule = "shortest_first"\n'
    role = ChildSpec(
        "rollout-0",
        RolloutRole,
        kwargs={
            "config": config(extra),
            "prompts_url": prompts_url,
            "samples_url": samples_url,
            "model_dir": str(spread_lengths(tiny_model(tmp_path), scale=60)),
        },
        placement=InProc(),
    )
    sup = await start([prompts, samples, role])
    try:
        async with await BusClient.connect(samples_url) as sample_bus:

            async def all_put() -> bool:
                return (await sample_bus.statistics())["rows"] == 2 * len(PROMPTS)

            await wait_until(all_put, 60.0, "every group on the bus", interval=0.1)
        stats = await sup.ref("rollout-0").call("statistics")
    finally:
        await sup.__aexit__(None, None, None)
    with SegmentLog(tmp_path / "samples" / "bus-log") as samples_log:
        puts = [op for _, r in samples_log.replay() if (op := loads(r))["op"] == "put"]
    groups = [{row["group"] for row in op["rows"]} for op in puts]
    assert all(len(g) == 1 for g in groups) and len(groups) == len(PROMPTS)  # one put a group
    ends = [max(len(row["columns"]["response_ids"]) for row in op["rows"]) for op in puts]
    assert ends == sorted(ends) and len(set(ends)) > 2, ends  # as they ended: shortest first
    assert stats["lengths"]["observed_groups"] == len(PROMPTS)
