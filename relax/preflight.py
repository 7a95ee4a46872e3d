"""The checks a cluster passes before anything starts: ``relax validate`` is the preflight.

``load_config`` checks what a ``cluster.toml`` says; ``preflight`` checks that it can run
here: the files it points at exist, every import path imports and names a callable that takes
the arguments the cluster will pass, options that are accepted but not built are refused with
what to use instead, the secret it names is in the environment and the fixed ports it asks for
are free. ``relax validate``, ``relax up`` and ``relax.cluster.prepare`` (so the embedding API
too) run exactly this function, before any run folder is made or model built.

    issues = preflight(cfg)          # [] or ConfigIssues with key paths, nothing started
    check(cfg)                       # the same, raising ConfigError
    cfg = load_checked("cluster.toml", ["trainer.steps=5"])  # load + preflight, with lines

It has no side effects beyond importing the user modules the config names (which is what
checking that they import means) and binding a socket for a moment to see that a fixed port is
free (``load_checked`` also appends the config's folder to ``sys.path``). It sits on the floor of ``relax.cluster``: it imports ``relax.config``, ``relax.rewards``
and ``relax.actors``, never torch (user modules may, of course).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from relax.config import MIN_SECRET_LENGTH, ClusterConfig, load_config, place_issues
from relax.errors import ConfigError, ConfigIssue
from relax.importpath import ImportPathError, load


def preflight(cfg: ClusterConfig) -> list[ConfigIssue]:
    """Every reason ``cfg`` cannot start on this machine, as config issues (empty: it can)."""
    issues: list[ConfigIssue] = []
    for check_part in (_files, _unbuilt, _imports, _rewards, _packages, _secret, _ports):
        issues += check_part(cfg)
    return issues


def check(cfg: ClusterConfig, *, source: str | None = None) -> None:
    """``preflight``, raising ``ConfigError`` with every issue when there is any."""
    issues = preflight(cfg)
    if issues:
        raise ConfigError(issues, source=source)


def load_checked(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> ClusterConfig:
    """``load_config(path, overrides)``, then the preflight: what ``relax validate`` and
    ``relax up`` run. Issues carry the line of their key in the file (or name the override
    that set it); raises ``ConfigError`` with all of them.

    The config's own folder is appended to ``sys.path`` first — after the standard library
    and site-packages, so a ``json.py`` there cannot replace the real one — because the
    config's import paths may name modules next to it.
    """
    cfg = load_config(path, overrides=overrides)
    folder = str(Path(path).expanduser().resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    issues = preflight(cfg)
    if issues:
        text = Path(path).read_text(encoding="utf-8-sig")
        placed = place_issues(issues, text, overrides)
        placed.sort(key=lambda issue: (issue.line is None, issue.line or 0))  # file order
        raise ConfigError(placed, source=os.fspath(path))
    return cfg


def resolve_secret(cfg: ClusterConfig) -> str | None:
    """The cluster's shared secret, from ``cluster.secret`` or the variable ``secret_env``
    names; ``ConfigError`` when that variable is missing or too short."""
    problem = _secret(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.cluster.secret_env:
        return os.environ[cfg.cluster.secret_env]
    return cfg.cluster.secret.get_secret_value() if cfg.cluster.secret else None


# --------------------------------------------------------------------------- files


def _files(cfg: ClusterConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []

    def model_folder(key: str, value: str | None, what: str) -> None:
        if value is None:
            return
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            reason = "does not exist" if not path.exists() else "has no config.json"
            hint = f"point {key} at a folder holding config.json and the {what} weights"
            if key == "model.path":
                hint += ", or use a [model.init] table for a tiny model"
            issues.append(
                ConfigIssue(
                    key,
                    f"{str(value)!r} {reason}: it must be a local Hugging Face model folder",
                    hint=hint,
                )
            )

    model_folder("model.path", cfg.model.path, "model")
    tokenizer = cfg.model.tokenizer
    if tokenizer not in (None, "byte") and not Path(tokenizer).expanduser().is_dir():
        issues.append(
            ConfigIssue(
                "model.tokenizer",
                f"tokenizer folder {tokenizer!r} does not exist",
                hint='set it to a tokenizer folder, "byte", or remove it to use the model\'s',
            )
        )
    if cfg.reference.enabled:
        model_folder("reference.model_path", cfg.reference.model_path, "reference")
    if cfg.critic.enabled:
        model_folder("critic.model_path", cfg.critic.model_path, "critic")
    data_path = cfg.data.path if _reads_prompts(cfg) else None
    if data_path is not None and not Path(data_path).expanduser().is_file():
        issues.append(
            ConfigIssue(
                "data.path",
                f"no such file {data_path!r} (relative paths start from {Path.cwd()})",
                hint="fix the path, or remove it to use the built-in arithmetic task",
            )
        )
    eval_path = cfg.eval.data.path if cfg.eval.every_steps > 0 else None
    if eval_path is not None and not Path(eval_path).expanduser().is_file():
        issues.append(
            ConfigIssue(
                "eval.data.path",
                f"no such file {eval_path!r} (relative paths start from {Path.cwd()})",
                hint="fix the path, or remove it to evaluate on the built-in task's held-out seed",
            )
        )
    return issues


def _reads_prompts(cfg: ClusterConfig) -> bool:
    # External agents bring their own tasks: the dataset role does not run.
    return cfg.rollout.agent.kind != "external"


# --------------------------------------------------------------------------- not built


def _children(cfg: ClusterConfig) -> list[tuple[str, Any]]:
    """(key prefix, table) of every child that runs."""
    children: list[tuple[str, Any]] = list(cfg.enabled_roles.items())
    return children + [(f"actors[{i}]", actor) for i, actor in enumerate(cfg.actors)]


VLLM_MAX_LORA_RANK = 512
"""The largest LoRA rank vLLM serves (``relax.engines._vllm_lora.VLLM_RANKS``; not imported:
the preflight never loads torch)."""
VLLM_NO_ADAPTER = ("lm_head", "embed_tokens")
"""Modules vLLM serves no LoRA adapter on (``relax.engines._vllm_lora.NOT_SERVED``)."""


def _vllm_lora(cfg: ClusterConfig) -> list[ConfigIssue]:
    """What of ``[model.lora]`` the vLLM engine cannot serve."""
    lora = cfg.model.lora
    if lora is None or not cfg.rollout.enabled or cfg.rollout.engine != "vllm":
        return []
    issues = []
    if lora.rank > VLLM_MAX_LORA_RANK:
        issues.append(
            ConfigIssue(
                "model.lora.rank",
                f"is {lora.rank}, but vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK}",
                hint=f'use a rank of at most {VLLM_MAX_LORA_RANK}, or rollout.engine = "hf"',
            )
        )
    refused = [name for name in lora.target_modules if name in VLLM_NO_ADAPTER]
    if refused:
        issues.append(
            ConfigIssue(
                "model.lora.target_modules",
                f"{refused} cannot carry an adapter on the vLLM engine, which serves LoRA on"
                " the decoder blocks' linear layers only",
                hint=f'leave out {refused}, or use rollout.engine = "hf"',
            )
        )
    return issues


def _unbuilt(cfg: ClusterConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = _vllm_lora(cfg)
    if cfg.cluster.ports.bus and cfg.bus_transport != "tcp":
        issues.append(
            ConfigIssue(
                "cluster.ports.bus",
                f"is only used when the bus runs over tcp, but it runs over {cfg.bus_transport}",
                hint='set bus.transport = "tcp", or cluster.ports.bus = 0',
            )
        )
    if cfg.cluster.ports.metrics and not cfg.logging.prometheus:
        issues.append(
            ConfigIssue(
                "cluster.ports.metrics",
                "is only used with logging.prometheus = true, which is off",
                hint="set logging.prometheus = true, or cluster.ports.metrics = 0",
            )
        )
    return issues


# --------------------------------------------------------------------------- imports


def _import(target: str) -> tuple[Any, ConfigIssue | None]:
    """The callable at ``"package.module:attr.path"``, or (None, an issue saying why not; its
    path is filled in by the caller)."""
    try:
        return load(target), None
    except ImportPathError as exc:
        return None, ConfigIssue("", str(exc), hint=exc.hint)


def _signature_problem(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> str | None:
    """Why ``fn(*args, **kwargs)`` cannot be called, from its signature alone (None: it can)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"cannot be called as the cluster calls it: {exc} (its signature is {signature})"
    return None


def _imported(
    issues: list[ConfigIssue],
    key: str,
    target: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    expected: str,
) -> Any:
    obj, problem = _import(target)
    if problem is not None:
        issues.append(replace(problem, path=key))
        return None
    why = _signature_problem(obj, args, kwargs)
    if why is not None:
        issues.append(ConfigIssue(key, f"{target!r} {why}", hint=f"it must be {expected}"))
        return None
    return obj


def _imports(cfg: ClusterConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    data, agent = cfg.data, cfg.rollout.agent
    if _reads_prompts(cfg) and data.generator is not None:
        _imported(
            issues,
            "data.generator",
            data.generator,
            (),
            {"seed": 0},
            "a function generator(seed=...) yielding prompt records",
        )
    if cfg.eval.every_steps > 0 and cfg.eval.data.generator is not None:
        _imported(
            issues,
            "eval.data.generator",
            cfg.eval.data.generator,
            (),
            {"seed": 0},
            "a function generator(seed=...) yielding prompt records",
        )
    if agent.kind == "env" and agent.env is not None:
        _imported(
            issues,
            "rollout.agent.env",
            agent.env,
            (),
            dict(agent.options),
            "an Env class (or factory) taking rollout.agent.options as keyword arguments",
        )
    if agent.kind == "openai" and agent.program is not None:
        _imported(
            issues,
            "rollout.agent.program",
            agent.program,
            ("http://127.0.0.1:0/v1", "key", {}),
            dict(agent.options),
            "a function fn(base_url, api_key, task, **options) returning the reward",
        )
    from relax.actors import Actor

    for index, actor in enumerate(cfg.actors):
        key = f"actors[{index}].start"
        obj = _imported(
            issues,
            key,
            actor.start,
            (),
            dict(actor.kwargs),
            "an Actor subclass taking actors.kwargs as keyword arguments",
        )
        if inspect.isclass(obj) and not issubclass(obj, Actor):
            issues.append(
                ConfigIssue(
                    key,
                    f"{actor.start!r} is a class but not a relax.actors.Actor",
                    hint="derive it from relax.actors.Actor",
                )
            )
    return issues


def _rewards(cfg: ClusterConfig) -> list[ConfigIssue]:
    """The reward functions, built exactly as the reward role builds them (imports, options)."""
    if not cfg.reward.enabled or cfg.rollout.agent.kind != "single":
        return []  # episodes carry their own reward: no reward role runs
    from relax.rewards import RewardSet

    issues: list[ConfigIssue] = []
    for index, function in enumerate(cfg.reward.functions):
        if function.kind == "python" and function.target is not None:
            _, problem = _import(function.target)
            if problem is not None:
                issues.append(replace(problem, path=f"reward.functions[{index}].target"))
    if issues:  # building the set would only report the same imports again
        return issues
    try:
        RewardSet.from_config(
            cfg.reward,
            answer_key=cfg.data.answer_key,
            max_response_tokens=cfg.rollout.max_new_tokens,
        )
    except ConfigError as exc:
        return list(exc.issues)
    return []


# --------------------------------------------------------------------------- environment


def _packages(cfg: ClusterConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []

    def need(key: str, module: str, what: str, extra: str) -> None:
        if importlib.util.find_spec(module) is None:
            issues.append(
                ConfigIssue(
                    key, f"{what} needs the {module!r} package, which is not installed", hint=extra
                )
            )

    from relax.actors import RAY_INSTALL_HINT

    on_ray = [key for key, child in _children(cfg) if child.placement == "ray"]
    if on_ray:  # one issue, at the first child that asks for Ray
        need(f"{on_ray[0]}.placement", "ray", 'placement "ray"', RAY_INSTALL_HINT)
    if cfg.rollout.enabled and cfg.rollout.engine == "vllm":
        need("rollout.engine", "vllm", 'engine "vllm"', 'pip install vllm, or use engine "hf"')
    if cfg.model.lora is not None and (cfg.trainer.enabled or cfg.rollout.enabled):
        need(
            "model.lora",
            "peft",
            "[model.lora]",
            "pip install 'relax-rl[lora]' (or: pip install peft)",
        )
    if cfg.trainer.enabled and cfg.trainer.backend == "deepspeed":
        need(
            "trainer.backend",
            "deepspeed",
            'backend "deepspeed"',
            'pip install deepspeed, or use backend "torch"',
        )
    from types import SimpleNamespace

    from relax.observe import check_sinks

    # One sink at a time, so each missing package is reported at its own key.
    sinks = {
        "logging.tensorboard": (cfg.logging.tensorboard, False),
        "logging.wandb.enabled": (False, cfg.logging.wandb.enabled),
    }
    for key, (tensorboard, wandb) in sinks.items():
        if not (tensorboard or wandb):
            continue
        try:
            check_sinks(
                SimpleNamespace(tensorboard=tensorboard, wandb=SimpleNamespace(enabled=wandb))
            )
        except ConfigError as exc:
            issues += [replace(issue, path=key) for issue in exc.issues]
    return issues


def _secret(cfg: ClusterConfig) -> list[ConfigIssue]:
    name = cfg.cluster.secret_env
    if name is None:
        return []
    value = os.environ.get(name)
    if value is None:
        return [
            ConfigIssue(
                "cluster.secret_env",
                f"the environment variable {name} is not set",
                hint=f"export {name}=... (at least {MIN_SECRET_LENGTH} characters) before"
                " starting the cluster",
            )
        ]
    if len(value) < MIN_SECRET_LENGTH:
        return [
            ConfigIssue(
                "cluster.secret_env",
                f"the secret in {name} must be at least {MIN_SECRET_LENGTH} characters,"
                f" got {len(value)}",
                hint='generate one with: python -c "import secrets;'
                ' print(secrets.token_urlsafe(32))"',
            )
        ]
    return []


def _ports(cfg: ClusterConfig) -> list[ConfigIssue]:
    """Fixed ports the cluster will listen on must be free now (0 means any free port)."""
    ports = cfg.cluster.ports
    wanted = [("control", cfg.cluster.host, ports.control)]
    if cfg.bus_transport == "tcp":
        wanted.append(("bus", cfg.cluster.host, ports.bus))
    if cfg.logging.prometheus:
        wanted.append(("metrics", "127.0.0.1", ports.metrics))
    issues = []
    for name, host, port in wanted:
        if not port:
            continue
        problem = _bind_problem(host, port)
        if problem:
            issues.append(
                ConfigIssue(
                    f"cluster.ports.{name}",
                    f"cannot listen on {host}:{port}: {problem}",
                    hint="pick another port, or 0 for a free one",
                )
            )
    return issues


def _bind_problem(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            if sys.platform != "win32":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


__all__ = ["check", "load_checked", "preflight", "resolve_secret"]
