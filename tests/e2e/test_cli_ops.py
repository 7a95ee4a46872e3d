"""Operating a cluster from the command line, as a user would: `relax init`, `relax up --detach`,
`relax status --json`, `relax logs`, `relax ckpt`, `relax down` — real processes throughout.

The cluster is the quickstart recipe (made shorter per step with ``--set``) with its rollout and
reward roles in their own processes, so stopping it has children to clean up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.actors.helpers import pid_alive
from tests.polling import poll_until

pytestmark = pytest.mark.slow

RELAX = [sys.executable, "-m", "relax.cli"]
FAST = [
    "--set", "trainer.steps=100000",  # still running when we look
    "--set", "rollout.max_new_tokens=8",
    "--set", "rollout.batch_size=2",
    "--set", "trainer.global_batch_size=8",
    "--set", "trainer.micro_batch_size=8",
    "--set", "checkpoint.every_steps=2",
    "--set", "rollout.placement=process",
    "--set", "reward.placement=process",
]  # fmt: skip


def relax(*args: Any, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RELAX, *(str(a) for a in args)], capture_output=True, text=True, timeout=timeout
    )


def status(run: Path) -> dict[str, Any]:
    result = relax("status", "--json", "--run-dir", run)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def tree_pids(snapshot: dict[str, Any]) -> dict[str, list[int]]:
    return {c["id"]: c["pids"] for c in snapshot["tree"]["children"]}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return not pid_alive(pid)  # a zombie: it exited, and waits for init to reap it


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.timeout(900)
def test_detach_status_logs_ckpt_down(tmp_path) -> None:
    toml = tmp_path / "cluster.toml"
    init = relax("init", "quickstart", "--output", toml)
    assert init.returncode == 0, init.stderr
    run = tmp_path / "runs" / "ops"
    up = relax("up", toml, "--detach", "--run-dir", run, *FAST, timeout=600)
    assert up.returncode == 0, up.stderr
    assert str(run) in up.stdout and "relax status" in up.stdout and "relax down" in up.stdout
    assert (run / "control.json").exists()  # `relax status` works right away
    cluster_pid = int((run / "up.pid").read_text())
    try:
        # Every role running, then the trainer version moving between two status calls.
        def all_running() -> dict[str, Any] | None:
            snapshot = status(run)
            pids = tree_pids(snapshot)
            return snapshot if all(pids.get(r) for r in ("rollout-0", "reward-0")) else None

        first = poll_until(all_running, 300, "every role to run", interval=0.2)
        assert first["pid"] == cluster_pid
        recorded = {first["pid"]} | {p for pids in tree_pids(first).values() for p in pids}
        assert len(recorded) >= 3, recorded  # the cluster and its process children

        def version() -> int:
            return status(run)["trainer"]["version"]

        v1 = poll_until(lambda: max(version(), 0), 300, "the first step", interval=0.2)
        v2 = poll_until(lambda: (v := version()) > v1 and v, 300, "a later version", interval=0.2)
        assert v2 > v1 >= 1
        later = status(run)
        assert tree_pids(later)["rollout-0"] == tree_pids(first)["rollout-0"]  # no restarts

        logs = relax("logs", "trainer", "-n", "3", "--run-dir", run)
        assert logs.returncode == 0 and " step " in logs.stdout, logs.stderr

        down = relax("down", "--run-dir", run, "--timeout", "120", timeout=300)
        assert down.returncode == 0, down.stderr
        assert "no process of the run is left" in down.stdout, down.stdout
        assert "resume with: relax up" in down.stdout
        for pid in recorded:  # no orphans: every process of the run is gone
            assert gone(pid), f"pid {pid} is still running"
    finally:
        if pid_alive(cluster_pid):
            os.killpg(cluster_pid, 9)

    # What the run folder holds after it stopped.
    assert not (run / "control.json").exists()
    up_log = (run / "up.log").read_text()
    assert "stopped on request" in up_log, up_log[-3000:]
    assert (run / "logs" / "trainer.jsonl").is_file()
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 2
    steps = sorted((run / "checkpoints").glob("step-*"))
    assert steps, "no checkpoint"
    assert {"reward.png", "loss.png", "staleness.png", "step_time.png"} <= {
        p.name for p in (run / "plots").iterdir()
    }
    listed = relax("ckpt", "list", "--run-dir", run)
    assert listed.returncode == 0 and steps[-1].name.split("-")[1].lstrip("0") in listed.stdout

    # The newest checkpoint, exported, is an ordinary Hugging Face model folder.
    out = tmp_path / "export"
    export = relax("ckpt", "export", "latest", out, "--run-dir", run)
    assert export.returncode == 0, export.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (
        model.config.hidden_size == 64
        and tokenizer.decode(tokenizer("2+2=")["input_ids"]) == "2+2="
    )

    # `relax plot` redraws them anywhere.
    plot = relax("plot", run, "--out", tmp_path / "charts")
    assert plot.returncode == 0 and (tmp_path / "charts" / "reward.png").exists(), plot.stderr


def test_bad_configs_start_nothing(tmp_path) -> None:
    toml = tmp_path / "cluster.toml"
    assert relax("init", "quickstart", "--output", toml).returncode == 0
    run = tmp_path / "runs" / "bad"
    for args in (
        ["--set", "trainer.steps=many"],
        ["--set", "rollout.replicas"],
        ["--set", "trainer.nope=1"],
    ):
        result = relax("up", toml, "--detach", "--run-dir", run, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert "nothing was started" in result.stderr
    missing = tmp_path / "models" / "absent"
    text = toml.read_text()
    start, end = text.index("\n[model.init]\n"), text.index("\n[data]\n")
    toml.write_text(text[:start] + f'\npath = "{missing}"\n' + text[end:])
    for extra in ([], ["--detach"]):
        result = relax("up", toml, "--run-dir", run, *extra)
        assert result.returncode == 2, result.stderr
        assert "model.path" in result.stderr and str(missing) in result.stderr
        assert "Hugging Face model folder" in result.stderr
    assert not run.exists() and not (tmp_path / "runs").exists()  # no run folder
    assert processes_mentioning(str(run)) == []  # and no process
