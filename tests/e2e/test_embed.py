"""A cluster embedded in the user's own asyncio program, fed by the user's own agent loop
through the ``Policy`` client (agent kind "external"): it trains, versions move, what the
user generated is what is trained, a cancelled call leaks nothing, the end of the run is
``run.done`` and ``RunFinished`` (never a bare connection reset), the run's log lines go to
``RUN_DIR/logs`` and not to the terminal — and the README's program runs as printed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relax import embed
from relax.agents import EndpointNotFound, connect, model_spans
from relax.config import parse_config
from relax.errors import RunFinished
from tests.e2e.audit import check_exactly_once, replay_samples_bus
from tests.tiny import tiny_toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.mark.timeout(180)
async def test_user_agent_loop_trains_an_embedded_cluster(tmp_path, capfd) -> None:
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
            except RunFinished:
                # The run ended (the trainer finished) while this loop was mid-episode: the
                # call that met the closing endpoint says so, and so does every later one.
                await asyncio.wait_for(run.done, 30)
            assert run.done.done() and run.done.result() is None and policy.finished
            with pytest.raises(RunFinished, match="the trainer finished its steps"):
                await policy.version()
            connector = policy._client().connector
        assert connector is None or connector.closed  # the client's sockets are closed
        await done
        status = await run.status()
    # Nothing of the run reached the terminal; its log lines are in its log files.
    out, err = capfd.readouterr()
    assert out == "" and '"event"' not in err and "child started" not in err, (out, err)
    logs = {p.name: p.read_text() for p in (tmp_path / "run" / "logs").iterdir()}
    assert {"trainer.jsonl", "rollout-0.jsonl"} <= logs.keys()
    assert any(
        json.loads(line)["event"] == "endpoint serving"
        for line in logs["rollout-0.jsonl"].splitlines()
    )
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


@pytest.mark.timeout(120)
async def test_a_client_from_the_run_folder_hears_the_run_finish(tmp_path, capfd) -> None:
    """``connect(run_dir)`` (what another process uses) also turns the closed endpoint into
    ``RunFinished``; ``console=True`` puts the run's log lines on the terminal as asked."""
    cfg = parse_config(tiny_toml("finishing", steps=1, extra='[rollout.agent]\nkind = "external"'))
    async with embed.start(cfg, tmp_path / "run", console=True) as run:
        async with await connect(run.run_dir, wait=60) as policy:
            with pytest.raises(RunFinished):
                for k in range(100):  # one step takes 8 sessions; then the run ends
                    session = f"s{k}"
                    await policy.chat([{"role": "user", "content": "1+1="}], session=session)
                    await policy.finish(
                        session, reward=float(k % 2), group=f"g{k // 4}", group_size=4
                    )
            with pytest.raises(RunFinished, match="closed when the cluster stopped"):
                await policy.version()
        await run.done
    assert "child started" in capfd.readouterr().err  # console=True: lines on stderr


README = Path(__file__).parents[2] / "README.md"
EXAMPLE = Path(__file__).parents[2] / "examples" / "embedded"


@pytest.mark.timeout(180)
def test_the_readme_embedding_program_runs_and_its_groups_train(tmp_path) -> None:
    """The program README.md prints (and ``examples/embedded/main.py`` holds) runs as it is,
    ends by itself when the trainer is done, prints nothing but its own line, and its groups
    of four give the trainer something to learn from (a group of one never would)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    [program] = [b for b in blocks if "embed.start(" in b]
    assert program == (EXAMPLE / "main.py").read_text()
    (tmp_path / "examples" / "embedded").mkdir(parents=True)
    shutil.copy(EXAMPLE / "cluster.toml", tmp_path / "examples" / "embedded")
    (tmp_path / "main.py").write_text(program)
    done = subprocess.run(
        [sys.executable, "main.py"], cwd=tmp_path, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no log lines, no progress bars
    [line] = done.stdout.splitlines()
    assert re.fullmatch(r"\d+ groups played; run folder runs/embedded-\S+", line), line
    [run_dir] = (tmp_path / "runs").iterdir()
    assert (run_dir / "logs" / "trainer.jsonl").exists()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("applied")]
    assert len(steps) == 8
    assert all(r["advantage_std"] > 0 for r in steps)  # every step had a group to learn from
