"""A cluster embedded in the user's own asyncio program, fed by the user's own agent loop
through the ``Policy`` client (agent kind "external"): it trains, versions move, what the
user generated is what is trained, and a cancelled call leaks nothing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from relax import embed
from relax.agents import AgentEndpointError, EndpointNotFound, connect, model_spans
from relax.config import parse_config
from relax.errors import PeerGone
from tests.e2e.audit import check_exactly_once, replay_samples_bus
from tests.tiny import tiny_toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.mark.timeout(180)
async def test_user_agent_loop_trains_an_embedded_cluster(tmp_path) -> None:
    cfg = parse_config(tiny_toml("embedded", steps=3, extra='[rollout.agent]\nkind = "external"'))
    generated: dict[str, list[list[int]]] = {}
    versions = []
    async with embed.start(cfg, tmp_path / "run") as run:
        assert "dataset" not in run.tree.child_ids()  # external agents bring their own tasks
        done = asyncio.ensure_future(run.wait())
        async with await run.policy() as policy:
            # A call cancelled by its caller mid-generation leaves the client and server fine.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(policy.generate("1+2=", max_tokens=400), 0.05)
            try:
                group = 0
                while not done.done() and group < 40:
                    versions.append(await policy.version())
                    for j in range(4):  # one group = four episodes of one task
                        session = f"task{group}-{j}"
                        messages = [{"role": "user", "content": f"{group}+{j}="}]
                        first = (await policy.chat(messages, session=session, max_tokens=3))[0]
                        messages += [first.message, {"role": "user", "content": "again"}]
                        second = (await policy.chat(messages, session=session, max_tokens=3))[0]
                        generated[session] = [first.token_ids, second.token_ids]
                        await policy.finish(
                            session, reward=float(j % 2), group=f"task{group}", group_size=4
                        )
                    group += 1
            except (PeerGone, AgentEndpointError):
                # The run ended (the trainer finished) while this loop was mid-episode: the
                # endpoint went away with it (or failed the call it was serving). Were it a real
                # failure mid-run, no more rows would come and the trainer would never finish.
                await asyncio.wait_for(asyncio.shield(done), 30)
            connector = policy._client().connector
        assert connector is None or connector.closed  # the client's sockets are closed
        await done
        status = await run.status()
    assert all(c["restart_count"] == 0 for c in status["children"])
    assert versions[-1] > versions[0]  # the user's loop saw the policy move
    ledger = replay_samples_bus(tmp_path / "run")
    check_exactly_once(ledger)
    assert len(ledger.trained) >= 3 * 8
    for uid in ledger.trained:
        cols = ledger.rows[uid]["columns"]
        assert model_spans(cols["loss_mask"], cols["response_ids"]) == generated[cols["session"]]
    # The endpoint is gone with the cluster, and says so.
    with pytest.raises(EndpointNotFound):
        await connect(tmp_path / "run")
