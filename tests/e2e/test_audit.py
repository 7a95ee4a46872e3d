"""The audit itself: the trainer's ledger catches what the bus log alone cannot."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.audit import BusLedger, check_trainer_ledger, read_logs


def ledger_file(run_dir: Path, *entries: tuple[int, bool, list[str]]) -> None:
    lines = [
        json.dumps({"step": s, "applied": a, "items": [[u, 1] for u in uids]})
        for s, a, uids in entries
    ]
    (run_dir / "trainer-ledger.jsonl").write_text("".join(line + "\n" for line in lines))


def bus(acked: list[str], commits: list[int]) -> BusLedger:
    return BusLedger(acks={"train": Counter(acked)}, commits=commits)


def test_a_clean_run_passes(tmp_path) -> None:
    ledger_file(tmp_path, (1, True, ["a", "b"]), (1, False, ["c"]), (2, True, ["d"]))
    summary = check_trainer_ledger(tmp_path, bus(["a", "b", "c", "d"], [0, 1, 2]))
    assert summary == {"steps": 2, "rows_trained": 3, "entries": 3}


def test_the_double_train_of_a_lost_commit_record_is_caught(tmp_path) -> None:
    # The bus served v1's weights without having logged its rows' ack; the restarted trainer
    # adopted v1 and trained v2 on the same rows. The bus log shows each row acked once.
    ledger_file(tmp_path, (1, True, ["a", "b"]), (2, True, ["a", "b"]))
    with pytest.raises(AssertionError, match="trained twice"):
        check_trainer_ledger(tmp_path, bus(["a", "b"], [0, 1, 2]))


def test_rows_trained_but_never_acked_are_caught(tmp_path) -> None:
    ledger_file(tmp_path, (1, True, ["a", "b"]))
    with pytest.raises(AssertionError, match="never acked"):
        check_trainer_ledger(tmp_path, bus(["a"], [0, 1]))


def test_rows_acked_that_no_step_consumed_are_caught(tmp_path) -> None:
    ledger_file(tmp_path, (1, True, ["a"]))
    with pytest.raises(AssertionError, match="no step used them"):
        check_trainer_ledger(tmp_path, bus(["a", "z"], [0, 1]))


def test_gaps_in_the_versions_or_the_lineage_are_caught(tmp_path) -> None:
    ledger_file(tmp_path, (1, True, ["a"]), (3, True, ["b"]))
    with pytest.raises(AssertionError, match="gaps"):
        check_trainer_ledger(tmp_path, bus(["a", "b"], [0, 1, 3]))
    with pytest.raises(AssertionError, match="do not descend"):
        check_trainer_ledger(tmp_path, bus(["a", "b"], [0, 1, 2, 3]))


def test_a_json_line_after_a_progress_bar_fragment_is_still_read(tmp_path: Path) -> None:
    started = {"event": "child started", "child": "rollout-0", "pids": [7]}
    log = tmp_path / "run.log"
    log.write_text(
        json.dumps({"event": "step", "step": 1})
        + "\n"
        # A child's tqdm bar wrote "\\rLoading weights: 100%|...|" with no newline yet, and
        # the supervisor's line landed right after it.
        + "\rLoading weights: 100%|##########| 27/27"
        + json.dumps(started)
        + "\n"
        + "a plain warning\n"
        + '{"not json\n'
    )
    logs = read_logs(log)
    assert logs.events("child started", child="rollout-0") == [started]
    assert [e["event"] for e in logs.json] == ["step", "child started"]
    assert logs.text == ["Loading weights: 100%|##########| 27/27", "a plain warning", '{"not json']
