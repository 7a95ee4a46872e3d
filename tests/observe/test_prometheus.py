"""The Prometheus exposition of a cluster status, and the loopback endpoint that serves it."""

from __future__ import annotations

import asyncio
import math
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from relax.observe import ACTOR_STATES, render, serve_metrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[list[str], Samples]:
    """Family names (in order) and every sample by (name, labels)."""
    families = list(text_string_to_metric_families(text))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return [f.name for f in families], samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def child(id_: str, state: str = "running", restarts: int = 0, **more: Any) -> dict[str, Any]:
    return {
        "id": id_,
        "kind": "worker",
        "placement": "inproc",
        "gang": 1,
        "restart": "permanent",
        "state": state,
        "pids": [123] if state == "running" else [],
        "restart_count": restarts,
        "uptime_s": 1.5 if state == "running" else None,
        "stats": {"queued": 2, "capacity": 128, "in_flight": 1, "handled": 40, "failed": 1}
        if state == "running"
        else None,
        **more,
    }


STATUS: dict[str, Any] = {
    "cluster": "obs",
    "run_dir": "/runs/obs-1",
    "uptime_s": 12.5,
    "paused": False,
    "metrics_url": "http://127.0.0.1:1/metrics",
    "tree": {
        "id": "obs",
        "kind": "supervisor",
        "intensity": 3,
        "restarts_in_period": 1,
        "gave_up": None,
        "children": [
            child("reward-0", restarts=2),
            child("rollout-0", state="crashed", restarts=4),
            {
                **child("sub"),
                "kind": "supervisor",
                "restarts_in_period": 0,
                "children": [child("w", restarts=1)],
            },
            {
                **child("trainer", placement="process"),
                "stats": {"calls": 3, "casts": 0, "heartbeats": 9, "pending_calls": 0},
            },
        ],
    },
    "bus": {
        "prompts": {"error": "bus restarting"},
        "samples": {
            "rows": 8,
            "capacity": 1024,
            "groups": 2,
            "leases": 1,
            "admitted_rows": 0,
            "trainer_version": 4,
            "staleness": "inf",
            "tasks": {"reward": {"pending": 8, "leased": 0, "acked": 0, "lag": 8}},
            "versions_in_flight": {"4": 8},
            "counters": {"put": 40, "leases": 8, "acked_reward": 32, "trained": 32},
            "service": {"requests": 121, "recovered_records": 0},
            "weights": {"published": 5, "current": 4, "bytes_in": 100, "versions": [3, 4]},
            "log": {"segments": 1, "bytes": 14122, "appended": 67, "fsync": "checkpoint"},
            "transport": {"requests": 121, "in_flight": 4, "clients": 5},
        },
    },
    "trainer": {
        "version": 4,
        "last": {
            "step": 4,
            "applied": True,
            "skipped_reason": None,
            "reward_mean": 0.5,
            "loss": -0.25,
            "approx_kl": 0.01,
            "entropy": 5.5,
            "step_time_s": 0.1,
            "version": 4.0,
        },
    },
    "rollouts": {"rollout-0": {"version": 4, "via_file": 3}, "rollout-1": {"error": "starting"}},
    "metrics": [],
}


def test_status_exposition() -> None:
    names, samples = parse(render(STATUS).decode())
    assert len(names) == len(set(names)), "one family per name"
    assert value(samples, "relax_cluster_info", cluster="obs", run_dir="/runs/obs-1") == 1
    assert value(samples, "relax_uptime_seconds") == 12.5
    assert value(samples, "relax_paused") == 0
    # The trainer: its version and the newest record's numbers.
    assert value(samples, "relax_trainer_version") == 4
    # The weights each rollout serves; one that did not answer is left out, not made up.
    assert value(samples, "relax_rollout_weights_version", rollout="rollout-0") == 4
    assert ("relax_rollout_weights_version", frozenset({("rollout", "rollout-1")})) not in samples
    for field, expected in [("reward_mean", 0.5), ("loss", -0.25), ("approx_kl", 0.01)]:
        assert value(samples, f"relax_trainer_{field}") == expected
    assert value(samples, "relax_trainer_step_time_s") == 0.1
    assert value(samples, "relax_trainer_applied") == 1
    assert not any(name == "relax_trainer_skipped_reason" for name, _ in samples)
    # Actors: restarts, up, state set, mailbox numbers; a nested supervisor's children.
    assert value(samples, "relax_actor_restarts_total", actor="reward-0") == 2
    assert value(samples, "relax_actor_restarts_total", actor="sub/w") == 1
    assert (
        value(samples, "relax_actor_up", actor="rollout-0", kind="worker", placement="inproc") == 0
    )
    states = {
        s: value(samples, "relax_actor_state", actor="rollout-0", state=s) for s in ACTOR_STATES
    }
    assert states == {s: float(s == "crashed") for s in ACTOR_STATES}
    assert value(samples, "relax_actor_queued", actor="reward-0", rank="0") == 2
    assert value(samples, "relax_actor_handled_total", actor="reward-0", rank="0") == 40
    assert value(samples, "relax_actor_heartbeats_total", actor="trainer", rank="0") == 9
    assert value(samples, "relax_supervisor_restarts_in_period", supervisor="obs") == 1
    assert value(samples, "relax_supervisor_intensity", supervisor="obs") == 3
    assert value(samples, "relax_supervisor_gave_up", supervisor="obs") == 0
    # Buses: a bus that did not answer is down; the other's gauges and counters.
    assert value(samples, "relax_bus_up", bus="prompts") == 0
    assert value(samples, "relax_bus_up", bus="samples") == 1
    assert value(samples, "relax_bus_rows", bus="samples") == 8
    assert value(samples, "relax_bus_open_leases", bus="samples") == 1
    assert math.isinf(value(samples, "relax_bus_staleness", bus="samples"))
    assert value(samples, "relax_bus_task_lag", bus="samples", task="reward") == 8
    assert value(samples, "relax_bus_version_rows", bus="samples", version="4") == 8
    assert value(samples, "relax_bus_put_total", bus="samples") == 40
    assert value(samples, "relax_bus_leases_total", bus="samples") == 8
    assert value(samples, "relax_bus_acked_reward_total", bus="samples") == 32
    assert value(samples, "relax_bus_dropped_stale_total", bus="samples") == 0  # not bumped yet
    assert value(samples, "relax_bus_weights_current", bus="samples") == 4
    assert value(samples, "relax_bus_weights_published_total", bus="samples") == 5
    assert value(samples, "relax_bus_weights_versions_held", bus="samples") == 2
    assert value(samples, "relax_bus_log_bytes", bus="samples") == 14122
    assert value(samples, "relax_bus_log_appended_total", bus="samples") == 67
    assert value(samples, "relax_bus_transport_in_flight", bus="samples") == 4
    assert value(samples, "relax_bus_service_requests_total", bus="samples") == 121
    # A private registry: nothing leaks into prometheus_client's global one.
    assert b"relax_" not in generate_latest(REGISTRY)


def test_an_empty_status_still_renders() -> None:
    names, _ = parse(render({}).decode())
    assert names == ["relax_cluster_info"]


def fetch(url: str, method: str = "GET") -> tuple[int, str, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


@pytest.mark.anyio
async def test_endpoint_serves_on_loopback_and_collects_on_each_scrape() -> None:
    scrapes = 0

    async def source() -> dict[str, Any]:
        nonlocal scrapes
        scrapes += 1
        if scrapes == 3:
            raise RuntimeError("status went away")
        return {**STATUS, "trainer": {"version": scrapes}}

    async with serve_metrics(source) as endpoint:
        assert endpoint.url.startswith("http://127.0.0.1:") and endpoint.url.endswith("/metrics")
        assert endpoint.port > 0
        for expected in (1, 2):
            code, kind, body = await asyncio.to_thread(fetch, endpoint.url)
            assert code == 200 and kind.startswith("text/plain; version=0.0.4")
            assert value(parse(body)[1], "relax_trainer_version") == expected
        code, _, body = await asyncio.to_thread(fetch, endpoint.url)
        assert code == 500 and "status went away" in body
        code, _, body = await asyncio.to_thread(fetch, endpoint.url, "HEAD")
        assert code == 200 and body == ""
        code, _, _ = await asyncio.to_thread(fetch, endpoint.url.replace("/metrics", "/other"))
        assert code == 404
        assert endpoint.scrapes == 3  # the failed one does not count
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(urllib.request.urlopen, endpoint.url, timeout=5)
