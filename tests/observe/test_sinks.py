"""Metrics sinks: JSONL, TensorBoard, W&B (faked), and the trainer's fan-out to them."""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog

from relax import cluster
from relax.observe import (
    JsonlSink,
    MetricsFanout,
    MetricsSink,
    MissingPackage,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    check_sinks,
    numeric_metrics,
)
from relax.roles._trainer import TrainerRole
from tests.observe.helpers import config, plain

RECORDS = [
    {
        "step": step,
        "applied": step != 2,
        "skipped_reason": None if step != 2 else "nan loss",
        "reward_mean": 0.25 * step,
        "loss": 1.0 / step,
        "rows": 8,
    }
    for step in (1, 2, 3)
]


def trainer(tmp_path: Path, extra: str = "") -> TrainerRole:
    """A trainer role that was never started: enough to call ``_record``."""
    return TrainerRole(
        config=plain(config(extra)),
        samples_url="inproc://none",
        model_dir="",
        run_dir=str(tmp_path),
    )


def event_accumulator() -> Any:
    """TensorBoard's reader (the `tensorboard` package comes with the dev extra)."""
    module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    return module.EventAccumulator


class Boom(MetricsSink):
    name = "boom"

    def __init__(self) -> None:
        self.calls = 0

    def write(self, record: Any) -> None:
        self.calls += 1
        raise OSError("disk on fire")

    def close(self) -> None:
        raise OSError("still on fire")


def test_numeric_metrics_keeps_numbers_and_booleans_only() -> None:
    got = numeric_metrics({"a": 1, "b": 2.5, "ok": True, "why": "x", "none": None, "l": [1]})
    assert got == {"a": 1.0, "b": 2.5, "ok": 1.0}
    assert numeric_metrics({"step": 3, "x": 1}, skip=("step",)) == {"x": 1.0}


def test_jsonl_sink_writes_the_metrics_jsonl_format(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "sub" / "metrics.jsonl")
    for record in RECORDS:
        sink.write(record)
    sink.close()
    text = (tmp_path / "sub" / "metrics.jsonl").read_text()
    assert text == "".join(json.dumps(r) + "\n" for r in RECORDS)


def test_tensorboard_sink_writes_one_scalar_per_numeric_metric_per_step(tmp_path: Path) -> None:
    EventAccumulator = event_accumulator()
    sink = TensorBoardSink(tmp_path / "tb")
    for record in RECORDS:
        sink.write(record)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"applied", "reward_mean", "loss", "rows"}
    reward = events.Scalars("reward_mean")
    assert [e.step for e in reward] == [1, 2, 3]
    assert [e.value for e in reward] == pytest.approx([0.25, 0.5, 0.75])
    assert [e.value for e in events.Scalars("applied")] == [1.0, 0.0, 1.0]


def test_wandb_sink_logs_numeric_metrics_at_their_step(tmp_path: Path, fake_wandb) -> None:
    sink = WandbSink(project="p", entity="team", run_dir=tmp_path, config={"k": 1})
    for record in RECORDS:
        sink.write(record)
    sink.close()
    (run,) = fake_wandb.runs
    assert run.init["project"] == "p" and run.init["entity"] == "team"
    assert run.init["dir"] == str(tmp_path) and run.init["config"] == {"k": 1}
    assert run.init["resume"] == "allow" and run.init["name"] == tmp_path.name
    assert [step for _, step in run.logged] == [1, 2, 3]
    assert run.logged[0][0] == {"applied": 1.0, "reward_mean": 0.25, "loss": 1.0, "rows": 8.0}
    assert run.finished
    # A restarted trainer continues the same W&B run.
    WandbSink(project="p", run_dir=tmp_path).close()
    assert fake_wandb.runs[1].init["id"] == run.init["id"]


def test_missing_packages_are_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    wandb_on = config('[logging.wandb]\nenabled = true\nproject = "p"\n')
    with pytest.raises(
        MissingPackage, match=r"'wandb' package is not installed: pip install wandb"
    ):
        check_sinks(wandb_on.logging)
    with pytest.raises(MissingPackage, match=r"logging\.wandb\.enabled"):
        cluster.prepare(wandb_on, tmp_path / "run")  # before anything is built
    assert not (tmp_path / "run").exists()
    with pytest.raises(MissingPackage, match=r"'tensorboard' package .*relax-rl\[tensorboard\]"):
        check_sinks(config("[logging]\ntensorboard = true\n").logging)
    check_sinks(config().logging)  # the defaults need nothing extra
    # Built anyway (a trainer): the sink is reported and left out, the others still work.
    failed: list[tuple[str, BaseException]] = []
    sinks = build_sinks(wandb_on.logging, tmp_path, on_error=lambda n, e: failed.append((n, e)))
    assert [s.name for s in sinks] == ["jsonl"]
    assert failed and failed[0][0] == "wandb" and isinstance(failed[0][1], MissingPackage)


def test_fanout_survives_a_raising_sink_and_warns(tmp_path: Path) -> None:
    boom, good = Boom(), JsonlSink(tmp_path / "m.jsonl")
    fanout = MetricsFanout([boom, good])
    with structlog.testing.capture_logs() as logs:
        for _ in range(12):
            fanout.write(RECORDS[0])
        fanout.close()
    assert boom.calls == 12
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 12
    warned = [e for e in logs if e["log_level"] == "warning"]
    # The 1st and 10th failing writes, then the failed close.
    assert [e["failures"] for e in warned] == [1, 10, 13]
    assert all(e["sink"] == "boom" and "disk on fire" in warned[0]["error"] for e in warned)


def test_record_fans_out_to_the_configured_sinks(tmp_path: Path, fake_wandb) -> None:
    EventAccumulator = event_accumulator()
    role = trainer(
        tmp_path, '[logging]\ntensorboard = true\n[logging.wandb]\nenabled = true\nproject = "p"\n'
    )
    for record in RECORDS:
        role._record(record)
    role._close_sinks()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == RECORDS  # the format of today
    assert role.metrics() == RECORDS
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    (run,) = fake_wandb.runs
    assert [step for _, step in run.logged] == [1, 2, 3] and run.finished
    assert run.init["config"]["cluster"]["name"] == "obs"


def test_the_role_keeps_only_the_latest_records_the_file_all(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(TrainerRole, "HISTORY_KEPT", 2)
    role = trainer(tmp_path)
    for record in RECORDS:
        role._record(record)
    role._close_sinks()
    assert role.metrics() == RECORDS[-2:]  # a long run's memory does not grow with it
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(RECORDS)


def test_record_never_breaks_on_a_failing_sink(tmp_path: Path) -> None:
    role = trainer(tmp_path)
    role._record(RECORDS[0])  # builds the configured sinks: metrics.jsonl only
    role._sinks.sinks.insert(0, Boom())
    with structlog.testing.capture_logs() as logs:
        role._record(RECORDS[1])
        role._record(RECORDS[2])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "metrics sink failed to write; training goes on"
    ]
    assert [e["step"] for e in logs if e["event"] == "step"] == [2, 3]


def test_record_without_jsonl_writes_no_file(tmp_path: Path) -> None:
    role = trainer(tmp_path, "[logging]\njsonl = false\n")
    role._record(RECORDS[0])
    assert not (tmp_path / "metrics.jsonl").exists() and role.metrics() == RECORDS[:1]


def test_record_survives_a_sink_that_cannot_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    role = trainer(tmp_path, '[logging.wandb]\nenabled = true\nproject = "p"\n')
    with structlog.testing.capture_logs() as logs:
        role._record(RECORDS[0])
    assert (tmp_path / "metrics.jsonl").exists()
    (warned,) = [e for e in logs if e["log_level"] == "warning"]
    assert warned["sink"] == "wandb" and "pip install wandb" in warned["error"]


def test_nan_metrics_go_through(tmp_path: Path, fake_wandb) -> None:
    sink = WandbSink(project="p", run_dir=tmp_path)
    sink.write({"step": 1, "loss": math.nan})
    sink.close()
    assert math.isnan(fake_wandb.runs[0].logged[0][0]["loss"])


def test_wandb_init_runs_off_the_caller_and_keeps_early_records(tmp_path: Path, fake_wandb) -> None:
    release = threading.Event()
    init = fake_wandb.init

    def slow_init(**kwargs: Any) -> Any:
        assert release.wait(30)  # the network, taking its time
        return init(**kwargs)

    fake_wandb.init = slow_init
    sink = WandbSink(project="p", run_dir=tmp_path)  # returns at once
    for record in RECORDS:
        sink.write(record)
    assert fake_wandb.runs == []
    release.set()
    sink.close()
    (run,) = fake_wandb.runs
    assert [step for _, step in run.logged] == [1, 2, 3] and run.finished


def test_wandb_init_failure_turns_into_warnings(tmp_path: Path, fake_wandb) -> None:
    def offline(**kwargs: Any) -> Any:
        raise ConnectionError("no network")

    fake_wandb.init = offline
    fanout = MetricsFanout([WandbSink(project="p", run_dir=tmp_path, init_timeout=30)])
    fanout.sinks[0]._init.join(30)
    with structlog.testing.capture_logs() as logs:
        fanout.write(RECORDS[0])
        fanout.close()
    assert [e["failures"] for e in logs] == [1, 2]
    assert all("no network" in e["error"] for e in logs)


def test_wandb_sink_forwards_the_evaluator_s_records_into_the_trainer_s_run(
    tmp_path: Path, fake_wandb
) -> None:
    """The evaluator writes eval.jsonl from its own process; the trainer's W&B run carries its
    records, each once, at the step the trainer was at, the final one at close."""
    evals = tmp_path / "eval.jsonl"

    def evaluated(version: int, reward: float, *, newline: bool = True) -> None:
        line = json.dumps({"step": version, "version": version, "eval/mean_reward": reward})
        with evals.open("a") as f:
            f.write(line + ("\n" if newline else ""))

    sink = WandbSink(project="p", run_dir=tmp_path)
    sink.write(RECORDS[0])  # no eval.jsonl yet
    evaluated(0, 0.1)
    evaluated(1, 0.5, newline=False)  # being written: waits for the next look
    sink.write(RECORDS[1])
    with evals.open("a") as f:
        f.write("\n")
    sink.write(RECORDS[2])
    evaluated(3, 0.9)  # the final evaluation, written as the run stops
    sink.close()
    (run,) = fake_wandb.runs
    forwarded = [
        (d["eval/version"], d["eval/mean_reward"], step)
        for d, step in run.logged
        if "eval/version" in d
    ]
    assert forwarded == [(0.0, 0.1, 2), (1.0, 0.5, 3), (3.0, 0.9, 3)]
    assert all("time" not in d for d, _ in run.logged)
