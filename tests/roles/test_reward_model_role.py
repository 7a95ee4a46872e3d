"""The reward role with a ``reward_model`` function scores bus rows end to end: it loads the
model once as it starts, and each row's reward is the model's score of its prompt + response."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relax.actors import ChildSpec, InProc
from relax.bus import BusClient, SegmentLog
from relax.models import build_byte_tokenizer
from relax.transport import dumps
from tests.polling import wait_until
from tests.rewards.model_builders import independent_scores, random_reward_model
from tests.roles.helpers import bus_spec, config, sample_rows, start, tiny_model

pytestmark = pytest.mark.anyio

PROMPTS = ["3+4=", "1+1=", "9+0=", "2+2="]


async def test_the_reward_role_scores_rows_with_a_reward_model(tmp_path: Path) -> None:
    from relax.roles._reward import RewardRole

    folder = random_reward_model(tmp_path / "rm")
    rows = sample_rows(4, prompt_text=PROMPTS, answer="4")
    rows[-1]["columns"]["response_ids"] = [ord("4")]  # sample_rows leaves the last one empty
    rows[-1]["columns"]["logprobs"] = [-1.0]
    log = SegmentLog(tmp_path / "samples" / "bus-log")
    log.append_many([dumps({"op": "put", "rows": rows})])
    log.close()
    bus, url = bus_spec(["reward", "train"], tmp_path)
    extra = f"""
[[reward.functions]]
name = "rm"
kind = "reward_model"
[reward.functions.model]
path = "{folder}"
device = "cpu"
batch_size = 3
"""
    role = ChildSpec(
        "reward-0",
        RewardRole,
        kwargs={
            "config": config(extra),
            "samples_url": url,
            "model_dir": str(tiny_model(tmp_path)),
        },
        placement=InProc(),
    )
    sup = await start([bus, role])
    try:
        async with await BusClient.connect(url) as client:
            got: dict[str, Any] = {}

            async def rewarded() -> bool:
                batch = await client.take_batch(
                    "train", batch_size=8, columns=["reward", "reward_components"], wait=1
                )
                for row in batch.rows:
                    got[row["uid"]] = row["columns"]
                if batch.rows:
                    await client.ack(batch)
                return len(got) == len(rows)

            await wait_until(rewarded, 60.0, "the reward model's rewards", interval=0.2)
    finally:
        await sup.__aexit__(None, None, None)
    tokenizer = build_byte_tokenizer()
    texts = {
        r["uid"]: r["columns"]["prompt_text"]
        + tokenizer.decode(r["columns"]["response_ids"], skip_special_tokens=True)
        for r in rows
    }
    uids = sorted(texts)
    expected = independent_scores(folder, [texts[uid] for uid in uids])
    assert [got[uid]["reward"] for uid in uids] == pytest.approx(expected, abs=1e-5)
    assert [got[uid]["reward_components"]["rm"] for uid in uids] == [
        got[uid]["reward"] for uid in uids
    ]
