"""Shared pieces of the role tests: a tiny model folder, configs, a bus under a supervisor."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

from relax.actors import ChildSpec, InProc, Supervisor
from relax.bus import BusClient, BusService, SegmentLog
from relax.cluster import plain_config
from relax.config import parse_config
from relax.models import build_tiny_model
from relax.roles._trainer import TrainerRole
from relax.transport import dumps
from tests.tiny import MODEL_INIT

_names = itertools.count()

INIT = parse_config(MODEL_INIT).model.init
"""The tiny policy of the whole-cluster tests (``tests.tiny``), as its ``[model.init]`` table."""
assert INIT is not None


def tiny_model(tmp_path: Path) -> Path:
    return build_tiny_model(INIT, tmp_path / "model")


def config(extra: str = "") -> dict[str, Any]:
    """A validated cluster config as the plain data roles receive."""
    text = f"""
{MODEL_INIT}
[data]
n_samples_per_prompt = 2

[trainer]
global_batch_size = 4
micro_batch_size = 2
"""
    return plain_config(parse_config(text + extra))


def sample_rows(n: int, *, seed: int = 0, group_size: int = 2, **columns: Any) -> list[dict]:
    """Bus rows with random prompts and responses of varied lengths (one empty response)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 6))]
        response = [] if i == n - 1 else [rng.randrange(258) for _ in range(rng.randint(1, 7))]
        rows.append(
            {
                "uid": f"g{i // group_size}/{i % group_size}",
                "group": f"g{i // group_size}",
                "group_size": group_size,
                "version": 0,
                "columns": {
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "logprobs": [-1.0] * len(response),
                    **{k: (v[i] if isinstance(v, list) else v) for k, v in columns.items()},
                },
            }
        )
    return rows


async def take_written(
    client: BusClient, column: str, count: int, *, writer: str
) -> dict[str, list[float]]:
    """``column`` of ``count`` rows, taken under task ``"train"`` as ``writer`` (a role under
    test) writes it: ``{uid: values}``. Fails when a 30 s wait brings no row."""
    got: dict[str, list[float]] = {}
    while len(got) < count:
        async with client.take("train", batch_size=16, columns=[column], wait=30.0) as batch:
            assert batch.rows, f"{writer} wrote no {column} within 30 s"
            for r in batch.rows:
                got[r["uid"]] = list(r["columns"][column])
    return got


async def start(children: list[ChildSpec]) -> Supervisor:
    sup = Supervisor(children, name="roles-test")
    await sup.__aenter__()
    return sup


def bus_spec(tasks: list[str], tmp_path: Path) -> tuple[ChildSpec, str]:
    url = f"inproc://roles-bus-{next(_names)}"
    spec = ChildSpec(
        "samples",
        BusService,
        kwargs={
            "url": url,
            "tasks": tasks,
            "trainer_task": "train",
            "run_dir": str(tmp_path / "samples"),
            "staleness": "inf",
        },
        placement=InProc(),
    )
    return spec, url


def prompts_spec(url: str, run_dir: Path, rows: list[dict[str, Any]]) -> ChildSpec:
    """A prompts bus at ``url`` that starts holding ``rows``: written into its log the way a
    bus logs a put (so rows today's bus would refuse can be planted too), replayed at start."""
    log = SegmentLog(run_dir / "bus-log")
    log.append_many([dumps({"op": "put", "rows": rows})])
    log.close()
    return ChildSpec(
        "prompts",
        BusService,
        kwargs={
            "url": url,
            "tasks": ["rollout"],
            "trainer_task": "rollout",
            "run_dir": str(run_dir),
            "staleness": "inf",
        },
        placement=InProc(),
    )


def one_step_trainer(samples_url: str, tmp_path: Path) -> ChildSpec:
    """A trainer of one step on the tiny model, in this process, writing ``tmp_path/run``."""
    return ChildSpec(
        "trainer",
        TrainerRole,
        kwargs={
            "config": config("steps = 1\n"),
            "samples_url": samples_url,
            "model_dir": str(tiny_model(tmp_path)),
            "run_dir": str(tmp_path / "run"),
        },
        placement=InProc(),
        restart="transient",
    )
