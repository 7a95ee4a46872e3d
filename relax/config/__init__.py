"""The ``cluster.toml`` schema and how it is loaded.

Everything a cluster needs to know is one validated, frozen ``ClusterConfig``. A bad file fails
here — before anything starts — with a ``ConfigError`` listing every problem found, each naming
its key path (``rollout.replicas``, ``actors[1].placement``), the line in the file, and a hint
where one helps.

    cfg = load_config("examples/quickstart/cluster.toml", overrides=["rollout.replicas=2"])
    cfg.staleness_bound        # 2.0, or inf for fully async
    print(cfg.summary())

This module sits on a low floor: it imports only the standard library, pydantic,
``relax.errors``, ``relax.schema`` and ``relax.importpath`` (and its own private
``relax.config._*`` helpers), so it stays quick to import. ``cfg.staleness`` is a ``relax.schema.Staleness``.
The field docstrings are the user documentation of every key; ``examples/quickstart/cluster.toml``
shows them all with their defaults.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from relax.config._base import (
    ConfigModel,
    FrozenList,
    Problems,
    StalenessSetting,
    format_path,
    show,
)
from relax.config._errors import problems_from
from relax.config._locate import key_lines, locate
from relax.config._models import (
    MIN_SECRET_LENGTH,
    MOE_ARCHS,
    AlgorithmConfig,
    BusConfig,
    CheckpointConfig,
    ClusterSection,
    DataConfig,
    EvalConfig,
    KLConfig,
    LoggingConfig,
    LoraConfig,
    MediaConfig,
    ModelConfig,
    ModelInitConfig,
    PortsConfig,
    RolloutCorrectionConfig,
    SupervisorConfig,
    WandbConfig,
    WeightsConfig,
)
from relax.config._overrides import apply_overrides, override_path
from relax.config._roles import (
    RESERVED_IDS,
    ROLE_NAMES,
    ActorConfig,
    AgentConfig,
    ChildConfig,
    CriticConfig,
    DatasetConfig,
    ReferenceConfig,
    RewardConfig,
    RewardFunctionConfig,
    RoleConfig,
    RolloutConfig,
    ServerConfig,
    TrainerConfig,
    VllmConfig,
)
from relax.errors import ConfigError, ConfigIssue

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PathPart = str | int

GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo")
"""Advantage estimators whose baseline is the other samples of the same prompt."""


class ClusterConfig(ConfigModel):
    """A whole ``cluster.toml``: every table is optional except ``[model]``."""

    staleness: StalenessSetting = Field(1, validate_default=True)
    """How many policy versions generation may run ahead of training: 0 is strict on-policy, k is bounded async, "inf" (or bare inf) is fully async."""
    cluster: ClusterSection = ClusterSection()
    """Name, network endpoints and shared secret of the cluster."""
    supervisor: SupervisorConfig = SupervisorConfig()
    """Restart strategy and limits of the root supervisor."""
    model: ModelConfig
    """The policy model (required): set model.path to a local model folder, or add a [model.init] table."""
    data: DataConfig = DataConfig()
    """What the prompts are (file, generator or the built-in task) and the group size."""
    dataset: DatasetConfig = DatasetConfig()
    """How the dataset role runs (it serves `[data]`)."""
    rollout: RolloutConfig = RolloutConfig()
    """How responses are generated."""
    reward: RewardConfig = RewardConfig()
    """How responses are scored."""
    reference: ReferenceConfig = ReferenceConfig()
    """The frozen reference policy for the KL term (off unless enabled)."""
    critic: CriticConfig = CriticConfig()
    """The value model for GAE (off unless enabled)."""
    trainer: TrainerConfig = TrainerConfig()
    """How the policy is optimised."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantage estimator, policy loss, KL and off-policy corrections."""
    bus: BusConfig = BusConfig()
    """The TransferQueue the roles exchange samples through."""
    weights: WeightsConfig = WeightsConfig()
    """How published weights reach the rollouts (a tensor group, or the bus)."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """When training state is saved and resumed."""
    logging: LoggingConfig = LoggingConfig()
    """Logs and metrics."""
    eval: EvalConfig = EvalConfig()
    """Evaluation of the policy on held-out prompts during training (off unless `every_steps` > 0)."""
    actors: FrozenList[ActorConfig] = ()
    """User actors started in the supervisor tree next to the roles, one [[actors]] table each."""

    # ------------------------------------------------------------------ checks

    @model_validator(mode="before")
    @classmethod
    def _norm_length_from_rollout(cls, data: Any) -> Any:
        """ "seq-mean-token-sum-norm" divides by a constant length: unless one is set, the
        generation budget ``rollout.max_new_tokens`` (Dr. GRPO's constant, and veRL's default:
        the padded response length)."""
        if not isinstance(data, dict):
            return data
        algorithm = data.get("algorithm")
        if (
            not isinstance(algorithm, dict)
            or algorithm.get("loss_aggregation") != "seq-mean-token-sum-norm"
            or "loss_norm_length" in algorithm
        ):
            return data
        rollout = data.get("rollout")
        budget = rollout.get("max_new_tokens") if isinstance(rollout, dict) else None
        if budget is None:
            budget = RolloutConfig.model_fields["max_new_tokens"].default
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            return data  # rollout.max_new_tokens is reported as it is
        return {**data, "algorithm": {**algorithm, "loss_norm_length": budget}}

    @field_validator("actors")
    @classmethod
    def _actor_ids_unique(cls, actors: tuple[ActorConfig, ...]) -> tuple[ActorConfig, ...]:
        problems = Problems()
        first_index: dict[str, int] = {}
        for index, actor in enumerate(actors):
            if actor.id in RESERVED_IDS:
                problems.add(
                    (index, "id"),
                    f"duplicate id {show(actor.id)}: the cluster already uses it"
                    + (" for a role" if actor.id in ROLE_NAMES else ""),
                    "pick another id; reserved: " + ", ".join(sorted(RESERVED_IDS)),
                )
            elif actor.id in first_index:
                problems.add(
                    (index, "id"),
                    f"duplicate id {show(actor.id)} (also actors[{first_index[actor.id]}])",
                )
            else:
                first_index[actor.id] = index
        problems.raise_if_any()
        return actors

    @model_validator(mode="after")
    def _sections_agree(self) -> ClusterConfig:
        problems = Problems()
        algorithm, data, trainer = self.algorithm, self.data, self.trainer
        if algorithm.advantage == "gae" and not self.critic.enabled:
            problems.add(
                ("algorithm", "advantage"),
                'advantage "gae" needs a value model, but the critic is disabled',
                "set [critic] enabled = true, or use a critic-free advantage such as grpo",
            )
        if algorithm.kl.coef > 0 and not self.reference.enabled:
            problems.add(
                ("algorithm", "kl", "coef"),
                f"a KL penalty ({algorithm.kl.coef:g}) needs reference log-probs,"
                " but the reference role is disabled",
                "set [reference] enabled = true, or kl.coef = 0",
            )
        group = data.n_samples_per_prompt
        if algorithm.advantage in GROUP_ADVANTAGES and group < 2:
            problems.add(
                ("data", "n_samples_per_prompt"),
                f"advantage {show(algorithm.advantage)} compares the samples of one prompt,"
                f" so it needs at least 2 per prompt, got {group}",
            )
        if trainer.global_batch_size % group:
            problems.add(
                ("trainer", "global_batch_size"),
                f"must be a multiple of data.n_samples_per_prompt ({group}) so a batch holds"
                f" whole groups, got {trainer.global_batch_size}",
            )
        if self.bus.capacity < trainer.global_batch_size:
            problems.add(
                ("bus", "capacity"),
                f"must hold at least one training batch (trainer.global_batch_size ="
                f" {trainer.global_batch_size}), got {self.bus.capacity}",
            )
        if self.bus.transport == "inproc":
            remote = [
                name for name, child in self._enabled_children() if child.placement != "inproc"
            ]
            if remote:
                problems.add(
                    ("bus", "transport"),
                    f'"inproc" only reaches children in this process, but {", ".join(remote)}'
                    f" {'runs' if len(remote) == 1 else 'run'} elsewhere",
                    'use "ipc" (one machine), "tcp" (several) or "auto"',
                )
        if self.eval.enabled and any(actor.id == "eval" for actor in self.actors):
            problems.add(
                ("eval", "every_steps"),
                'the evaluator is the child "eval", but an [[actors]] table already has that id',
                "rename that actor",
            )
        if trainer.routing_replay and self.rollout.engine == "vllm":
            problems.add(
                ("trainer", "routing_replay"),
                "routing replay (R3) replays the experts the rollout engine chose, and the"
                ' "vllm" engine does not report them to Relax (vLLM 0.32 can return them'
                " with enable_return_routed_experts, on its Model Runner V2 only, which needs"
                " Triton and a GPU: not wired in yet)",
                'use rollout.engine = "hf", or routing_replay = false',
            )
        init = self.model.init
        if trainer.routing_replay and init is not None and init.arch not in MOE_ARCHS:
            problems.add(
                ("trainer", "routing_replay"),
                f"routing replay (R3) needs a mixture-of-experts model, but model.init.arch is"
                f" {show(init.arch)}",
                'set model.init.arch = "qwen3_moe" (or "qwen3_omni_moe"), or routing_replay ='
                " false",
            )
        needed = data.max_prompt_tokens + self.rollout.max_new_tokens
        if init is not None and init.max_position_embeddings < needed:
            problems.add(
                ("model", "init", "max_position_embeddings"),
                f"must be at least data.max_prompt_tokens + rollout.max_new_tokens = {needed},"
                f" got {init.max_position_embeddings}",
            )
        problems.raise_if_any()
        return self

    # ------------------------------------------------------------------ derived views

    @property
    def staleness_bound(self) -> float:
        """The staleness as a number: ``k`` as a float, ``math.inf`` when fully async."""
        return self.staleness.limit

    @property
    def staleness_mode(self) -> str:
        """``on-policy (0)``, ``one-step off-policy (k=1)``, ``bounded async (k=3)`` or ``fully async (inf)``."""
        k = self.staleness.versions
        if k is None:
            return "fully async (inf)"
        if k == 0:
            return "on-policy (0)"
        if k == 1:
            return "one-step off-policy (k=1)"
        return f"bounded async (k={k})"

    @property
    def roles(self) -> dict[str, RoleConfig]:
        """Every role's table by name, in ``ROLE_NAMES`` order (enabled or not)."""
        return {name: getattr(self, name) for name in ROLE_NAMES}

    @property
    def enabled_roles(self) -> dict[str, RoleConfig]:
        """The roles that run, by name."""
        return {name: role for name, role in self.roles.items() if role.enabled}

    def _enabled_children(self) -> list[tuple[str, ChildConfig]]:
        children: list[tuple[str, ChildConfig]] = list(self.enabled_roles.items())
        if self.eval.enabled:  # the evaluator is a child like a role (placement, transport)
            children.append(("eval", self.eval))
        return children + [(actor.id, actor) for actor in self.actors]

    def shutdown_for(self, child: ChildConfig) -> float | Literal["brutal_kill"]:
        """A child's shutdown timeout: its own ``shutdown``, else ``[supervisor] shutdown``."""
        return self.supervisor.shutdown if child.shutdown is None else child.shutdown

    @property
    def bus_transport(self) -> Literal["inproc", "ipc", "tcp"]:
        """The transport the bus uses, with ``"auto"`` resolved from the children's placements."""
        if self.bus.transport != "auto":
            return self.bus.transport
        placements = {child.placement for _, child in self._enabled_children()}
        if "ray" in placements:
            return "tcp"
        return "ipc" if "process" in placements else "inproc"

    def summary(self) -> str:
        """A few lines describing the cluster, for `relax validate` and start-up logs."""
        return _summary(self)


# --------------------------------------------------------------------------- summary


def _child_line(name: str, child: ChildConfig, replicas: int, extra: Sequence[str]) -> str:
    parts = [f"{replicas} x {child.placement}"]
    if child.gang > 1:
        parts.append(f"gang of {child.gang}")
    parts += extra
    return f"    {name:<10} " + ", ".join(parts)


def _summary(cfg: ClusterConfig) -> str:
    model = cfg.model
    if model.init is not None:
        init = model.init
        model_text = (
            f"tiny {init.arch} built on the spot ({init.num_layers} layers, hidden"
            f" {init.hidden_size}, vocab {init.vocab_size})"
        )
    else:
        model_text = str(model.path)
    model_text += f", tokenizer {model.effective_tokenizer}, {model.dtype}"
    data = cfg.data
    source = {"path": data.path, "generator": data.generator, "builtin": "built-in arithmetic task"}
    kl = cfg.algorithm.kl
    algorithm = cfg.algorithm
    algorithm_text = f"{algorithm.advantage} advantages, {algorithm.loss} loss, " + (
        f"KL {kl.estimator} x {kl.coef:g} in the {kl.mode}" if kl.coef > 0 else "no KL"
    )
    if algorithm.off_policy != "none":
        algorithm_text += f", {algorithm.off_policy} correction"
    extras: dict[str, list[str]] = {
        "rollout": [f"engine {cfg.rollout.engine}", f"{cfg.rollout.max_new_tokens} new tokens"],
        "reward": ["functions " + ", ".join(f"{f.name} ({f.kind})" for f in cfg.reward.functions)],
        "trainer": [
            cfg.trainer.backend
            + (
                f" ZeRO-{cfg.trainer.effective_zero_stage}"
                if cfg.trainer.backend == "deepspeed"
                else ""
            ),
            f"{cfg.trainer.steps} steps of {cfg.trainer.global_batch_size} samples",
        ],
    }
    lines = [
        f"cluster {show(cfg.cluster.name)}: {cfg.staleness_mode}",
        f"  model      {model_text}",
        f"  data       {source[data.source]}, {data.n_samples_per_prompt} samples per prompt",
        f"  algorithm  {algorithm_text}",
        "  roles",
    ]
    disabled = []
    for name, role in cfg.roles.items():
        if role.enabled:
            lines.append(_child_line(name, role, role.replicas, extras.get(name, [])))
        else:
            disabled.append(name)
    if disabled:
        lines.append(f"    (disabled: {', '.join(disabled)})")
    if cfg.actors:
        lines.append("  actors")
        for actor in cfg.actors:
            lines.append(_child_line(actor.id, actor, 1, [actor.start]))
    supervisor = cfg.supervisor
    restarts = "restart" if supervisor.intensity == 1 else "restarts"
    lines += [
        f"  bus        {cfg.bus_transport}, capacity {cfg.bus.capacity} rows"
        + (", persisted" if cfg.bus.persist else ""),
        f"  supervisor {supervisor.strategy}, at most {supervisor.intensity} {restarts}"
        f" in {supervisor.period:g} s",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- loading


def validate_config(
    data: Mapping[str, Any],
    *,
    text: str | None = None,
    source: str | None = None,
    overrides: Sequence[str] = (),
) -> ClusterConfig:
    """Validate parsed TOML ``data`` (after applying ``overrides``) into a ``ClusterConfig``.

    ``text`` is the TOML it came from, used only to report line numbers. Raises ``ConfigError``
    listing every problem found.
    """
    if overrides:
        data = apply_overrides(data, overrides)
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        lines = key_lines(text) if text else {}
        # Problems in an overridden key come from the command line, not from a file line.
        overridden = []
        for override in overrides:
            key_path = override_path(override.partition("=")[0].strip())
            if key_path:
                overridden.append((key_path, override))
        issues: list[ConfigIssue] = []
        for path, message, hint in problems_from(exc, ClusterConfig):
            line = locate(lines, path)
            for key_path, override in overridden:
                if path[: len(key_path)] == key_path:
                    # Keep the problem's own hint ("did you mean ...?"): a typo on the
                    # command line deserves the same help as one in the file.
                    note = f"set by override {override!r}"
                    line, hint = None, f"{hint}; {note}" if hint else note
            issue = ConfigIssue(path=format_path(path), message=message, line=line, hint=hint)
            if issue not in issues:
                issues.append(issue)
        issues.sort(key=lambda issue: (issue.line is None, issue.line or 0))
        raise ConfigError(issues, source=source) from None


def place_issues(
    issues: Sequence[ConfigIssue], text: str | None, overrides: Sequence[str] = ()
) -> list[ConfigIssue]:
    """``issues`` found after loading (by ``relax.preflight``), each given the line of its key
    in ``text`` — or, for a key an override set, a note naming the override instead."""
    lines = key_lines(text) if text else {}
    overridden = [
        (key_path, override)
        for override in overrides
        if (key_path := override_path(override.partition("=")[0].strip()))
    ]
    placed = []
    for issue in issues:
        path = override_path(issue.path) or ()
        line, hint = (issue.line if issue.line is not None else locate(lines, path)), issue.hint
        for key_path, override in overridden:
            if path[: len(key_path)] == key_path:
                note = f"set by override {override!r}"
                line, hint = None, f"{hint}; {note}" if hint else note
        placed.append(ConfigIssue(path=issue.path, message=issue.message, line=line, hint=hint))
    return placed


_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)|\s*\(at end of document\)")


def parse_config(
    text: str, *, source: str = "<string>", overrides: Sequence[str] = ()
) -> ClusterConfig:
    """Parse and validate the TOML ``text`` of a cluster config; ``source`` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raw = str(getattr(exc, "msg", None) or exc)
        line = getattr(exc, "lineno", None)
        column = getattr(exc, "colno", None)
        match = _TOML_POSITION.search(str(exc))
        if line is None and match and match.group(1):
            line, column = int(match.group(1)), int(match.group(2))
        elif line is None and match:
            line = text.count("\n") + 1
        message = _TOML_POSITION.sub("", raw).strip() or "cannot parse"
        where = f" at column {column}" if column else ""
        issue = ConfigIssue(path="", message=f"invalid TOML: {message}{where}", line=line)
        raise ConfigError([issue], source=source) from None
    return validate_config(data, text=text, source=source, overrides=overrides)


def load_config(path: str | os.PathLike[str], *, overrides: Sequence[str] = ()) -> ClusterConfig:
    """Read, parse and validate the cluster config at ``path`` (``overrides`` applied first).

    Raises ``ConfigError`` for an unreadable file, invalid TOML or any invalid key (all of them
    at once). Files the config points to (model folders, data files), import paths and the
    environment are not checked here: ``relax.preflight`` does that, before anything starts.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8-sig") as handle:  # -sig: tolerate a BOM
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError("no such file", source=source) from None
    except IsADirectoryError:
        raise ConfigError("cannot read it: it is a folder, not a file", source=source) from None
    except PermissionError:
        raise ConfigError("cannot read it: permission denied", source=source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read it: not UTF-8 text ({exc.reason})", source=source) from None
    except OSError as exc:
        raise ConfigError(f"cannot read it: {exc.strerror or exc}", source=source) from None
    return parse_config(text, source=source, overrides=overrides)


__all__ = [
    "GROUP_ADVANTAGES",
    "MIN_SECRET_LENGTH",
    "RESERVED_IDS",
    "ROLE_NAMES",
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "BusConfig",
    "CheckpointConfig",
    "ChildConfig",
    "ClusterConfig",
    "ClusterSection",
    "ConfigError",
    "ConfigIssue",
    "CriticConfig",
    "DataConfig",
    "DatasetConfig",
    "EvalConfig",
    "KLConfig",
    "LoggingConfig",
    "LoraConfig",
    "MediaConfig",
    "ModelConfig",
    "ModelInitConfig",
    "PortsConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RoleConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "ServerConfig",
    "SupervisorConfig",
    "TrainerConfig",
    "VllmConfig",
    "WandbConfig",
    "WeightsConfig",
    "apply_overrides",
    "load_config",
    "override_path",
    "parse_config",
    "place_issues",
    "validate_config",
]
