"""The reference role: per-token log-probs of responses under the frozen reference policy."""

from __future__ import annotations

import math

import pytest
import torch

from relax.actors import ChildSpec, InProc
from relax.bus import BusClient
from relax.models import load_policy
from relax.roles import ReferenceRole
from relax.roles._reference import reference_logprobs
from relax.training import pack_batch, response_values, sequence_logprobs
from tests.roles.helpers import bus_spec, config, sample_rows, start, take_written, tiny_model

pytestmark = pytest.mark.anyio


def direct(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each response token, one unpadded row at a time."""
    if not response:
        return []
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    p = len(prompt)
    return [logp[p - 1 + j, tok].item() for j, tok in enumerate(response)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_logprobs_equal_a_direct_recompute(tmp_path, temperature) -> None:
    model, _ = load_policy(tiny_model(tmp_path))
    rows = [r["columns"] for r in sample_rows(9)]
    got = reference_logprobs(model, rows, pad_id=256, temperature=temperature, micro_batch_size=4)
    assert [len(g) for g in got] == [len(r["response_ids"]) for r in rows]
    assert got[-1] == []  # an empty response gets an empty column
    for row, values in zip(rows, got, strict=True):
        want = direct(model, row["prompt_ids"], row["response_ids"], temperature)
        assert values == pytest.approx(want, abs=1e-5)


def test_reference_logprobs_are_what_the_trainer_computes(tmp_path) -> None:
    """Same alignment as the trainer's recompute: a whole padded batch through
    ``pack_batch`` + ``sequence_logprobs`` gives the same numbers."""
    model, _ = load_policy(tiny_model(tmp_path))
    rows = [r["columns"] for r in sample_rows(8)]
    packed = pack_batch([{**r, "reward": 0.0, "group": "g"} for r in rows], pad_id=256)
    with torch.no_grad():
        trainer = response_values(packed, sequence_logprobs(model, packed, 1.0))
    got = reference_logprobs(model, rows, pad_id=256, micro_batch_size=3)
    for a, b in zip(got, trainer, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


async def test_the_role_writes_ref_logprobs_for_every_row(tmp_path) -> None:
    model_dir = tiny_model(tmp_path)
    cfg = config(
        "[reference]\nenabled = true\n[algorithm.kl]\ncoef = 0.1\n[rollout]\ntemperature = 0.8\n"
    )
    bus, url = bus_spec(["reference", "train"], tmp_path)
    role = ChildSpec(
        "reference-0",
        ReferenceRole,
        kwargs={"config": cfg, "samples_url": url, "model_dir": str(model_dir)},
        placement=InProc(),
    )
    rows = sample_rows(6)
    sup = await start([bus, role])
    try:
        async with await BusClient.connect(url) as client:
            await client.put(rows)
            got = await take_written(client, "ref_logprobs", len(rows), writer="the reference role")
        stats = await sup.ref("reference-0").call("statistics")
        assert stats["scored"] == len(rows)
    finally:
        await sup.__aexit__(None, None, None)
    model, _ = load_policy(model_dir)
    for row in rows:
        cols = row["columns"]
        want = direct(model, cols["prompt_ids"], cols["response_ids"], 0.8)
        assert got[row["uid"]] == pytest.approx(want, abs=1e-5)
        assert all(math.isfinite(x) and x <= 0 for x in got[row["uid"]])
