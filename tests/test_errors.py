"""Relax's exceptions keep their type, message and attributes across process boundaries.

Each registered type is raised in a real child process (an actor with ``Process`` placement)
and in a bus handler reached over tcp, and the caller catches exactly that type.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import pytest

import cli
import relax
from relax import errors
from relax.actors import Actor, ChildSpec, Exit, Process, Supervisor
from relax.bus import BusClient, BusService
from relax.errors import (
    REGISTERED,
    BusError,
    ColumnConflict,
    ConfigError,
    ConfigIssue,
    RelaxError,
    RemoteError,
    UnknownTask,
    VersionGone,
    error_from_dict,
    error_to_dict,
)
from relax.roles._common import write_once

pytestmark = pytest.mark.anyio

_EXIT = Exit("exception", "it broke", error_type="ValueError", traceback="Traceback ...", at=1.5)

# One instance of every registered type, with attributes set where the type has them. A new
# type without a sample here fails test_every_registered_type_has_a_sample.
SAMPLES: dict[str, Callable[[], RelaxError]] = {
    "RelaxError": lambda: errors.RelaxError("the root"),
    "ConfigError": lambda: errors.ConfigError(
        [
            ConfigIssue("rollout.replicas", "expected an integer", line=4, hint="did you mean 2?"),
            ConfigIssue("", "the file is empty"),
        ],
        source="cluster.toml",
    ),
    "MissingPackage": lambda: errors.MissingPackage("wandb", "logging.wandb.enabled", "wandb"),
    "OptionError": lambda: errors.OptionError("abs_tol", "tolerances must be non-negative"),
    "StartFailed": lambda: errors.StartFailed("a: failed to start", actor_id="a", cause=_EXIT),
    "ActorDead": lambda: errors.ActorDead("actor 'b' died", actor_id="b", cause=_EXIT),
    "CallTimeout": lambda: errors.CallTimeout("no reply within 2.0s"),
    "RemoteError": lambda: errors.RemoteError(
        "deep down", remote_type="mylib.Oops", remote_traceback="Traceback (deep)"
    ),
    "SupervisorGaveUp": lambda: errors.SupervisorGaveUp("too many", supervisor_id="root"),
    "ClusterNotRunning": lambda: errors.ClusterNotRunning("no running cluster in runs/x"),
    "RunFinished": lambda: errors.RunFinished("the run has ended"),
    "EndpointNotFound": lambda: errors.EndpointNotFound("no endpoint file"),
    "AgentEndpointError": lambda: errors.AgentEndpointError(
        "bad temperature", status=400, type="invalid_request_error", param="temperature", code="x"
    ),
    "TransportError": lambda: errors.TransportError("cannot decode"),
    "PeerGone": lambda: errors.PeerGone("peer at tcp://x gone"),
    "AuthFailed": lambda: errors.AuthFailed("wrong secret"),
    "MessageTooLarge": lambda: errors.MessageTooLarge("12 bytes > 10"),
    "BadFrame": lambda: errors.BadFrame("bad magic"),
    "Closed": lambda: errors.Closed("socket closed"),
    "BusError": lambda: errors.BusError("no row 'u' on the bus"),
    "VersionGone": lambda: errors.VersionGone("weight version 3 is gone; the latest is 5"),
    "UnknownTask": lambda: errors.UnknownTask("unknown consumer task 'rewrd'"),
    "ColumnConflict": lambda: errors.ColumnConflict("row 'u': column 'reward' was written"),
    "LogCorrupt": lambda: errors.LogCorrupt("checksum mismatch", path="bus/0.seg", offset=4096),
    "UploadLost": lambda: errors.UploadLost("no open upload of weight version 4"),
    "WeightsCorrupt": lambda: errors.WeightsCorrupt("weight version 4: buckets [1] do not match"),
    "BadRow": lambda: errors.BadRow("p/0", "group_size", "must be a positive integer"),
    "BadColumn": lambda: errors.BadColumn("p/0", "reward", "is not finite (nan)"),
    "EngineError": lambda: errors.EngineError("top_k must be positive"),
    "MediaError": lambda: errors.MediaError("image", "cat.png", "missing file"),
    "ChatFormatError": lambda: errors.ChatFormatError("the tokenizer has no chat template"),
    "PlotError": lambda: errors.PlotError("no metrics yet"),
    "RecordError": lambda: errors.RecordError("no record"),
    "Unrecoverable": lambda: errors.Unrecoverable("user code fails every time"),
    "RewardFailing": lambda: errors.RewardFailing("20 groups failed in a row", failed_groups=20),
}


def _attributes(exc: BaseException) -> dict[str, Any]:
    """What a caller reads off the error: its attributes (``ConfigError.issues`` included)."""
    return {k: v for k, v in vars(exc).items() if not k.startswith("__")}


class Raiser(Actor):
    """Raises what it is asked to, in whatever process it was placed."""

    async def fail(self, name: str) -> None:
        raise SAMPLES[name]()

    async def fail_builtin(self, which: str) -> None:
        if which == "key":
            raise KeyError("missing")
        if which == "file":
            raise FileNotFoundError(2, "No such file or directory", "data.jsonl")
        raise _NotOurs("a user's own exception")


class _NotOurs(Exception):
    pass


def _relax_modules() -> list[str]:
    names = []
    for package in (relax, cli):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not info.name.endswith("__main__"):  # running it would start the CLI
                names.append(info.name)
    return names


def test_every_relax_exception_is_registered() -> None:
    for name in _relax_modules():
        importlib.import_module(name)
    ours = {
        cls
        for cls in errors._subclasses(RelaxError)
        if cls.__module__.split(".")[0] in ("relax", "cli")
    }
    missing = sorted(f"{c.__module__}.{c.__qualname__}" for c in ours - set(REGISTERED.values()))
    assert not missing, f"define these in relax/errors.py (and re-export them): {missing}"
    assert all(cls.__module__ == "relax.errors" for cls in REGISTERED.values())


def test_every_registered_type_has_a_sample() -> None:
    assert sorted(SAMPLES) == sorted(REGISTERED)
    for name, make in SAMPLES.items():
        assert type(make()) is REGISTERED[name]


def test_old_import_paths_still_give_the_same_classes() -> None:
    from relax.agents import AgentEndpointError, ChatFormatError, EndpointNotFound
    from relax.bus import ColumnConflict, LogCorrupt, UnknownTask, VersionGone
    from relax.control import ClusterNotRunning
    from relax.engines import EngineError
    from relax.media import MediaError
    from relax.observe import MissingPackage
    from relax.plot import PlotError
    from relax.replay import RecordError
    from relax.rewards import OptionError
    from relax.transport._rpc_aio import Closed
    from relax.transport._rpc_frames import BadFrame

    moved = [AgentEndpointError, ChatFormatError, EndpointNotFound, ColumnConflict, LogCorrupt]
    moved += [UnknownTask, VersionGone, ClusterNotRunning, EngineError, MediaError]
    moved += [MissingPackage, PlotError, OptionError, Closed, BadFrame, RecordError]
    for cls in moved:
        assert REGISTERED[cls.__name__] is cls
    assert issubclass(ChatFormatError, RelaxError) and issubclass(ChatFormatError, ValueError)
    assert issubclass(OptionError, ConfigError)


def test_a_round_trip_in_this_process_keeps_type_message_and_attributes() -> None:
    for name, make in SAMPLES.items():
        sent = make()
        back = error_from_dict(error_to_dict(sent))
        assert type(back) is type(sent), name
        assert str(back) == str(sent), name
        assert _attributes(back) == _attributes(sent), name


def test_what_a_peer_names_is_never_imported_or_trusted() -> None:
    def remote(data: dict[str, Any]) -> RemoteError:
        exc = error_from_dict(data)
        assert type(exc) is RemoteError
        return exc

    # A type outside the registry, a registered name from another module, and builtins that
    # must not be raised into a caller (SystemExit is no Exception; StopIteration breaks
    # futures) all stay RemoteError.
    assert remote({"type": "system", "module": "os", "message": "rm -rf"}).remote_type == (
        "os.system"
    )
    remote({"type": "VersionGone", "module": "relax.bus._weights", "message": "x"})
    remote({"type": "SystemExit", "module": "builtins", "message": "0"})
    remote({"type": "StopIteration", "module": "builtins", "message": ""})
    remote({"type": "_subclasses", "module": "relax.errors", "message": ""})
    assert type(error_from_dict("not a dict")) is RemoteError
    # Attributes of the wrong shape are dropped, not trusted.
    bad = error_from_dict(
        {
            "type": "ConfigError",
            "module": "relax.errors",
            "message": "1 problem",
            "attrs": {"issues": [{"path": 3, "message": None, "line": "4", "hint": 5}, "x"]},
        }
    )
    assert isinstance(bad, ConfigError) and str(bad) == "1 problem"
    assert bad.issues == [ConfigIssue("3", ""), ConfigIssue("", "x")]


def test_a_user_subclass_of_a_relax_error_stays_remote() -> None:
    class MyBusError(BusError):
        pass

    exc = error_from_dict(error_to_dict(MyBusError("mine")))
    assert type(exc) is RemoteError and exc.remote_type.endswith("MyBusError")


@pytest.mark.slow
async def test_every_registered_type_survives_a_process_child() -> None:
    async with Supervisor([ChildSpec("raiser", Raiser, placement=Process())]) as sup:
        ref = sup.ref("raiser")
        for name, make in SAMPLES.items():
            sent, cls = make(), REGISTERED[name]
            with pytest.raises(cls) as info:
                await ref.call("fail", name)
            assert type(info.value) is cls, f"{name} came back as {type(info.value).__name__}"
            assert str(info.value) == str(sent)
            assert _attributes(info.value) == _attributes(sent), name
            assert "Remote traceback" in "".join(getattr(info.value, "__notes__", []))
        config = await _raised(ref, "fail", "ConfigError")
        assert config.issues[0].hint == "did you mean 2?" and config.issues[0].line == 4
        started = await _raised(ref, "fail", "StartFailed")
        assert started.cause == _EXIT and isinstance(started.cause, Exit)
        corrupt = await _raised(ref, "fail", "LogCorrupt")
        assert (corrupt.path, corrupt.offset) == ("bus/0.seg", 4096)
        # Builtins come back as themselves with their arguments; anything else is RemoteError.
        with pytest.raises(KeyError) as key:
            await ref.call("fail_builtin", "key")
        assert key.value.args == ("missing",)
        with pytest.raises(FileNotFoundError) as missing:
            await ref.call("fail_builtin", "file")
        assert str(missing.value) == "[Errno 2] No such file or directory: 'data.jsonl'"
        with pytest.raises(RemoteError) as other:
            await ref.call("fail_builtin", "other")
        assert other.value.remote_type == "tests.test_errors._NotOurs"


async def _raised(ref: Any, method: str, *args: Any) -> Any:
    try:
        await ref.call(method, *args)
    except RelaxError as exc:
        return exc
    raise AssertionError(f"{method}{args} did not raise")


def _row(uid: str, **columns: Any) -> dict[str, Any]:
    return {"uid": uid, "group": uid, "group_size": 1, "version": 0, "columns": columns}


async def test_bus_errors_reach_a_tcp_client_as_their_own_types(tmp_path) -> None:
    spec = ChildSpec(
        "bus",
        BusService,
        kwargs={"url": "tcp://127.0.0.1:0", "tasks": ["reward", "train"], "run_dir": str(tmp_path)},
    )
    async with Supervisor([spec]) as sup:
        url = await sup.ref("bus").call("address")
        assert url.startswith("tcp://127.0.0.1:")
        async with await BusClient.connect(url) as bus:
            with pytest.raises(VersionGone, match="weight version 7 is gone"):
                await bus._call({"op": "w_get", "version": 7, "index": 0})
            with pytest.raises(UnknownTask, match="'rewrd'"):
                await bus.take_batch("rewrd", batch_size=1, wait=0)

            # Per-row refusals of one columns_many are exception objects, not strings.
            await bus.put([_row("a", reward=1.0), _row("b")])
            refused = await bus.add_columns_many(
                [("a", {"reward": 0.5}), ("gone", {"reward": 1.0}), ("b", {"reward": 0.0})]
            )
            assert type(refused[0]) is ColumnConflict and "'reward'" in str(refused[0])
            assert type(refused[1]) is BusError and "no row 'gone'" in str(refused[1])
            assert refused[2] is None
            # write_once: a conflicting rewrite counts as already written; a missing row fails.
            assert await write_once(bus, [("a", {"reward": 0.25}), ("b", {"reward": 0.0})]) == 1
            with pytest.raises(BusError, match="1 column writes refused") as info:
                await write_once(bus, [("gone", {"reward": 1.0})])
            assert type(info.value.__cause__) is BusError
