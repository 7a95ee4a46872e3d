"""Every live bus connection of a cluster has a name of its own: a restarted role takes back
what was held under its name (``BusClient.reclaim``), so two replicas sharing one would take
each other's leases. (Replicas of reward, reference and critic were all named by their gang
rank, ``reward-0``.)"""

from __future__ import annotations

import pytest

from relax.actors import ActorContext
from relax.config import parse_config
from relax.roles import _critic, _reference, _reward
from relax.roles._common import client_name
from tests.tiny import tiny_toml

pytestmark = pytest.mark.anyio


def test_replicas_and_gang_ranks_get_names_of_their_own() -> None:
    names = [client_name(ActorContext(id=f"reward-{i}")) for i in range(3)]
    assert names == ["reward-0", "reward-1", "reward-2"]
    gang = [client_name(ActorContext(id="trainer", rank=r, size=2)) for r in range(2)]
    assert gang == ["trainer", "trainer.1"]


class _Connected(Exception):
    """Raised by the stand-in connect_bus: the name is all this test wants."""


@pytest.mark.parametrize(
    ("module", "role"),
    [
        (_reward, _reward.RewardRole),
        (_reference, _reference.ReferenceRole),
        (_critic, _critic.CriticRole),
    ],
)
async def test_a_replicated_role_connects_under_its_child_s_name(
    monkeypatch: pytest.MonkeyPatch, module, role
) -> None:
    names = []

    async def connect_bus(url, cfg, name):  # type: ignore[no-untyped-def]
        names.append(name)
        raise _Connected

    monkeypatch.setattr(module, "connect_bus", connect_bus)
    replica = object.__new__(role)  # only what run() reads before it connects
    replica.context = ActorContext(id="replica-2")
    replica.cfg = parse_config(tiny_toml("names"))
    replica.samples_url = "inproc://unused"
    replica.critic = object()
    with pytest.raises(_Connected):
        await replica.run()
    assert names == ["replica-2"]
