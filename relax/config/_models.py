"""The non-role tables of ``cluster.toml``, one pydantic model each.

Roles and user actors are in ``_roles``; the top level, ``ClusterConfig``, is in
``relax.config``.

The attribute docstring under each field is its user documentation: keep it accurate, and say
the unit. Checks that span several keys of one table live in that table's model (so they run
even when another section has errors); checks spanning sections live in ``ClusterConfig``.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import PurePath
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from relax.config._base import (
    ConfigModel,
    Dtype,
    Fraction,
    ImportPath,
    NonNegativeFloat,
    NonNegativeInt,
    Port,
    PositiveFloat,
    PositiveInt,
    Problems,
    SafeName,
    Seconds,
    Shutdown,
    raise_one,
    show,
    value_error,
)

MIN_SECRET_LENGTH = 16


# --------------------------------------------------------------------------- [cluster]


class PortsConfig(ConfigModel):
    """``[cluster.ports]``: where the cluster listens when it talks TCP."""

    control: Port = 0
    """TCP port of the control endpoint (`relax status`, `relax down`) on `cluster.host`; 0 picks a free one (over ipc on one machine, tcp when the bus is). `relax validate` checks a fixed port is free."""
    bus: Port = 0
    """Port of the TransferQueue when the bus runs over TCP (only then: set with another transport, it is refused); 0 picks a free port, held for the run so a restarted bus gets it again."""
    metrics: Port = 0
    """Port of the Prometheus metrics endpoint; 0 picks a free port."""

    @model_validator(mode="after")
    def _ports_differ(self) -> PortsConfig:
        problems = Problems()
        seen: dict[int, str] = {}
        for name in ("control", "bus", "metrics"):
            port = getattr(self, name)
            if port == 0:
                continue
            if port in seen:
                problems.add(name, f"port {port} is already used by cluster.ports.{seen[port]}")
            else:
                seen[port] = name
        problems.raise_if_any()
        return self


_RAY_ADDRESS = re.compile(r"(?:ray://)?(?:[^\s:/\[\]]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}")


class RayClusterConfig(ConfigModel):
    """``[cluster.ray]``: the Ray cluster that children with placement "ray" run on (only read when one does)."""

    address: str = "local"
    """"local" starts a private Ray instance for this run on 127.0.0.1 and stops it at the end; "auto" joins the Ray cluster already running on this machine (`ray start`); "host:port" joins the cluster whose head's control store listens there (what `ray start --head` prints, e.g. "10.0.0.5:6379"); "ray://host:port" connects through Ray Client."""
    num_cpus: PositiveInt | None = None
    """Logical CPUs of the private instance (address "local" only); unset means the machine's cores. Each Ray child reserves its `[<role>.ray] num_cpus` of them."""

    @field_validator("address")
    @classmethod
    def _address_form(cls, address: str) -> str:
        if address not in ("local", "auto") and not _RAY_ADDRESS.fullmatch(address):
            raise value_error(
                f'must be "local", "auto", "host:port" or "ray://host:port", got {show(address)}',
                'use "local" for a private Ray instance on this machine',
            )
        return address

    @model_validator(mode="after")
    def _cpus_only_when_local(self) -> RayClusterConfig:
        if self.num_cpus is not None and self.address != "local":
            raise_one(
                "num_cpus",
                f"sets the size of a private Ray instance, but address is {show(self.address)}",
                'remove it (the cluster has its own size), or use address = "local"',
            )
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ClusterSection(ConfigModel):
    """``[cluster]``: the cluster's name and how its processes reach each other."""

    name: SafeName = "relax"
    """Name of this cluster: used for the run folder, log records and metrics (letters, digits, `_`, `.`, `-`)."""
    host: str = "127.0.0.1"
    """Address the control, bus and metrics endpoints bind to. Anything but loopback needs a `secret` or `secret_env`."""
    ports: PortsConfig = PortsConfig()
    """The TCP ports the cluster listens on."""
    ray: RayClusterConfig = RayClusterConfig()
    """Where children with placement "ray" run (see `[cluster.ray]`)."""
    secret: SecretStr | None = None
    """Shared secret every TCP connection must prove it holds (at least 16 characters). Prefer `secret_env` so it stays out of files."""
    secret_env: str | None = None
    """Name of the environment variable that holds the shared secret; read once when the cluster starts (`relax validate` fails when it is not set) and used by the buses, every role and the control endpoint."""
    run_dir: str = "runs"
    """Folder (relative to the working directory) where each run writes logs, metrics and checkpoints."""

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, host: str) -> str:
        if not host.strip():
            raise value_error("must not be empty", 'use "127.0.0.1" to stay on this machine')
        return host

    @field_validator("secret")
    @classmethod
    def _secret_long_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value()) < MIN_SECRET_LENGTH:
            length = len(secret.get_secret_value())
            raise value_error(
                f"must be at least {MIN_SECRET_LENGTH} characters, got {length}",
                'generate one with: python -c "import secrets; print(secrets.token_urlsafe(32))"',
            )
        return secret

    @field_validator("secret_env")
    @classmethod
    def _env_name(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise value_error(f"must be an environment variable name, got {show(name)}")
        return name

    @field_validator("run_dir")
    @classmethod
    def _run_dir_not_empty(cls, run_dir: str) -> str:
        if not run_dir.strip():
            raise value_error("must not be empty")
        return run_dir

    @model_validator(mode="after")
    def _secret_when_exposed(self) -> ClusterSection:
        problems = Problems()
        if self.secret is not None and self.secret_env is not None:
            problems.add("secret_env", "set either secret or secret_env, not both")
        if not _is_loopback(self.host) and self.secret is None and self.secret_env is None:
            problems.add(
                "host",
                f"binding to {show(self.host)} exposes the cluster beyond this machine,"
                " so a shared secret is required",
                "set cluster.secret_env (or cluster.secret), or bind to 127.0.0.1",
            )
        problems.raise_if_any()
        return self


# --------------------------------------------------------------------------- [supervisor]


class SupervisorConfig(ConfigModel):
    """``[supervisor]``: how the root supervisor reacts when a child dies (Erlang/OTP semantics)."""

    strategy: Literal["one_for_one", "rest_for_one", "one_for_all"] = "one_for_one"
    """Which children restart when one dies: only it, it and those started after it, or all."""
    intensity: NonNegativeInt = 1
    """Most restarts allowed within `period` seconds before the supervisor gives up (OTP's default is 1)."""
    period: Seconds = 5.0
    """Window, in seconds, over which `intensity` restarts are counted (OTP's default is 5)."""
    shutdown: Shutdown = 5.0
    """Default seconds a child gets to stop cleanly before it is killed, or "brutal_kill"; a child's own `shutdown` overrides it."""


# --------------------------------------------------------------------------- [bus]


class BusConfig(ConfigModel):
    """``[bus]``: the TransferQueue every role exchanges samples through."""

    transport: Literal["auto", "inproc", "tcp", "ipc"] = "auto"
    """How roles reach the bus: "inproc" (same process), "ipc" (same machine), "tcp" (across machines), or "auto" (inproc when every child is inproc, tcp when any uses Ray, ipc otherwise)."""
    capacity: PositiveInt = 1024
    """Most sample rows the bus holds; producers wait when it is full. At least `trainer.global_batch_size`."""
    frame_bytes: PositiveInt = 4 << 20
    """Size, in bytes, of the frames large messages are split into on the wire."""
    max_message_bytes: PositiveInt = 256 << 20
    """Largest message, in bytes, the bus accepts; at least `frame_bytes`."""
    lease_timeout: Seconds = 60.0
    """Seconds a consumer may hold rows without acknowledging them before they return to the queue."""
    persist: bool = True
    """Append every change (rows, columns, leases, acks, versions) to a checksummed log under the run folder, so a bus killed and restarted loses nothing. Turn off only for throwaway runs."""
    segment_bytes: PositiveInt = 64 << 20
    """Size, in bytes, at which the on-disk log starts a new segment file (with `persist`)."""
    fsync: Literal["checkpoint", "always", "never"] = "checkpoint"
    """When the on-disk log is flushed to the disk: at each checkpoint, after every write, or never."""

    @model_validator(mode="after")
    def _message_fits(self) -> BusConfig:
        if self.max_message_bytes < self.frame_bytes:
            raise_one(
                "max_message_bytes",
                f"must be at least frame_bytes ({self.frame_bytes}), got {self.max_message_bytes}",
            )
        return self


# --------------------------------------------------------------------------- [model]


class ModelInitConfig(ConfigModel):
    """``[model.init]``: a small randomly initialised model, built on the spot (no download)."""

    arch: Literal["qwen2", "llama", "qwen2_5_omni"] = "qwen2"
    """Architecture: "qwen2" or "llama" (text), or "qwen2_5_omni" (a Qwen2.5-Omni thinker: text decoder of these sizes plus tiny vision and audio towers, with an offline processor for images, audio and video)."""
    hidden_size: PositiveInt = 64
    """Width of the hidden state; a multiple of `num_heads`."""
    num_layers: PositiveInt = 2
    """Number of transformer blocks."""
    num_heads: PositiveInt = 4
    """Attention heads per layer; a multiple of `num_kv_heads`."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads per layer (grouped-query attention)."""
    intermediate_size: PositiveInt = 128
    """Width of the MLP's hidden layer."""
    vocab_size: PositiveInt = 512
    """Number of token ids; at least the tokenizer's vocabulary."""
    max_position_embeddings: PositiveInt = 1024
    """Longest sequence (prompt + response) the model supports."""
    seed: int = 0
    """Seed of the random initial weights."""

    @model_validator(mode="after")
    def _shapes_fit(self) -> ModelInitConfig:
        problems = Problems()
        if self.hidden_size % self.num_heads:
            problems.add(
                "hidden_size",
                f"must be a multiple of num_heads ({self.num_heads}), got {self.hidden_size}",
            )
        if self.num_heads % self.num_kv_heads:
            problems.add(
                "num_kv_heads",
                f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}",
            )
        problems.raise_if_any()
        return self


class ModelConfig(ConfigModel):
    """``[model]``: the policy model; set exactly one of ``path`` and ``[model.init]``."""

    path: str | None = None
    """Local Hugging Face model folder. Its existence is checked when the cluster starts, not here."""
    init: ModelInitConfig | None = None
    """A tiny model to build on the spot instead of loading one (see `[model.init]`)."""
    tokenizer: str | None = None
    """Tokenizer: a local folder, or "byte" for the built-in offline byte-level tokenizer. Unset means the model folder's tokenizer with `path`, "byte" with `init`."""
    dtype: Dtype = "float32"
    """Precision the model is loaded in for generation and scoring."""
    trust_remote_code: bool = False
    """Allow the model folder to run its own Python code (only for folders you trust)."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        problems = Problems()
        if self.path is not None and self.init is not None:
            problems.add((), "has both path and [model.init]; keep exactly one")
        elif self.path is None and self.init is None:
            problems.add(
                (),
                "no model given: set model.path to a local model folder, or add a [model.init] table",
            )
        if self.path is not None and not self.path.strip():
            problems.add("path", "must not be empty")
        if self.tokenizer is not None and not self.tokenizer.strip():
            problems.add("tokenizer", 'must not be empty; use "byte" or a folder')
        problems.raise_if_any()
        return self

    @property
    def effective_tokenizer(self) -> str:
        """The tokenizer to load: the explicit one, else the model folder, else "byte"."""
        if self.tokenizer is not None:
            return self.tokenizer
        return self.path if self.path is not None else "byte"


# --------------------------------------------------------------------------- [data]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class MediaConfig(ConfigModel):
    """``[data.media]``: limits applied once, when the dataset role decodes a prompt's images, audio and video; an item outside them is cut down to fit or, where that cannot be done, its prompt is skipped with the reason logged."""

    max_pixels: PositiveInt = 512 * 512
    """Largest image or video frame, in pixels (height x width); bigger ones are scaled down, aspect ratio kept."""
    min_pixels: PositiveInt = 28 * 28
    """Smallest image or video frame, in pixels; smaller ones are scaled up (vision towers need at least one 28x28 patch group)."""
    max_frames: PositiveInt = 32
    """Most frames a video keeps after sampling at `video_fps`; longer clips are thinned evenly (or refused when `truncate` is false)."""
    video_fps: PositiveFloat = 2.0
    """Frames per second sampled from a video whose frame rate is known."""
    max_audio_seconds: PositiveFloat = 30.0
    """Longest audio clip, in seconds; longer ones are cut (or refused when `truncate` is false)."""
    sample_rate: PositiveInt = 16_000
    """Rate in Hz every audio clip is resampled to (the processor's feature extractor expects it)."""
    max_bytes: PositiveInt = 64 * 1024 * 1024
    """Largest media item, in bytes (encoded source and decoded pixels alike)."""
    resample: bool = True
    """Resample audio at another rate; false refuses it."""
    truncate: bool = True
    """Cut long audio and thin long videos; false refuses them."""

    @model_validator(mode="after")
    def _pixels_ordered(self) -> MediaConfig:
        if self.min_pixels > self.max_pixels:
            problems = Problems()
            problems.add(
                "min_pixels",
                f"must not exceed max_pixels ({self.max_pixels}), got {self.min_pixels}",
            )
            problems.raise_if_any()
        return self


class DataConfig(ConfigModel):
    """``[data]``: what the prompts are. (``[dataset]`` says how the role serving them runs.)

    Set ``path`` or ``generator``, not both; with neither, Relax uses its built-in synthetic
    arithmetic task, so a cluster runs without any download.
    """

    path: str | None = None
    """Local file of prompts: JSON Lines (".jsonl", ".json") or Parquet (".parquet"); checked when the cluster starts."""
    generator: ImportPath | None = None
    """Import path "package.module:function" of a function yielding prompt records, instead of a file."""
    prompt_key: str = "prompt"
    """Field of each record holding the prompt."""
    answer_key: str = "answer"
    """Field of each record holding the reference answer reward functions compare against."""
    shuffle: bool = True
    """Shuffle the records (each epoch) before serving them."""
    seed: int = 0
    """Seed of the shuffle and of the built-in synthetic task."""
    n_samples_per_prompt: PositiveInt = 4
    """Group size: responses generated per prompt (group baselines like GRPO need at least 2)."""
    max_prompt_tokens: PositiveInt = 256
    """Prompts longer than this many tokens are skipped (and counted). Media placeholders count: an image is as many tokens as the processor gives it."""
    media: MediaConfig = MediaConfig()
    """Limits of images, audio and video in prompts (see `[data.media]`)."""

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        problems = Problems()
        if self.path is not None and self.generator is not None:
            problems.add("generator", "set either data.path or data.generator, not both")
        if self.path is not None:
            suffix = PurePath(self.path).suffix.lower()
            if suffix not in DATA_SUFFIXES:
                problems.add(
                    "path",
                    f"unsupported file type {show(suffix or self.path)}; expected one of"
                    f" {', '.join(DATA_SUFFIXES)}",
                )
        for key in ("prompt_key", "answer_key"):
            if not getattr(self, key):
                problems.add(key, "must not be empty")
        problems.raise_if_any()
        return self

    @property
    def source(self) -> Literal["path", "generator", "builtin"]:
        """Where prompts come from."""
        if self.path is not None:
            return "path"
        return "generator" if self.generator is not None else "builtin"


# --------------------------------------------------------------------------- [algorithm]


class KLConfig(ConfigModel):
    """``[algorithm.kl]``: the penalty keeping the policy near the reference model."""

    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2 or k3; k3 is unbiased and always ≥ 0)."""
    coef: NonNegativeFloat = 0.0
    """Weight of the KL term; 0 turns it off (and above 0 needs `[reference] enabled = true`)."""
    mode: Literal["reward", "loss"] = "loss"
    """Where the penalty goes: subtracted from the reward per token, or added to the loss."""


class AlgorithmConfig(ConfigModel):
    """``[algorithm]``: how advantages and the policy loss are computed."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """Advantage estimator: "grpo", "dr_grpo", "rloo" (group baselines), "reinforce_pp" (REINFORCE++), or "gae" (needs `[critic]`)."""
    loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    """Policy loss: "ppo_clip" (token-level clipped ratio), "gspo" (sequence-level ratio) or "cispo" (clipped importance weights)."""
    clip_low: float = Field(0.2, gt=0, allow_inf_nan=False)
    """Lower clip range: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, gt=0, allow_inf_nan=False)
    """Upper clip range: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher uses e.g. 0.28)."""
    dual_clip: float | None = Field(None, gt=1, allow_inf_nan=False)
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; unset disables it."""
    aggregation: Literal["token", "sequence"] = "token"
    """How per-token losses are averaged: over all tokens of the batch, or per sequence first."""
    kl: KLConfig = KLConfig()
    """The KL penalty against the reference model."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus; 0 turns it off."""
    off_policy: Literal["none", "tis", "icepop", "decoupled"] = "none"
    """Correction for the gap between the generating and the trained policy: none, truncated importance sampling, IcePop, or decoupled PPO."""
    tis_cap: float = Field(2.0, gt=0, allow_inf_nan=False)
    """Cap of the importance weights used by "tis" and "icepop"."""
    dynamic_sampling: bool = False
    """Drop groups whose samples all got the same reward (they carry no signal), as in DAPO."""
    gamma: Fraction = 1.0
    """Discount factor, used by "gae" and "reinforce_pp"."""
    lam: Fraction = 0.95
    """GAE's λ, trading bias for variance; used only by "gae"."""


# --------------------------------------------------------------------------- [checkpoint], [logging]


class CheckpointConfig(ConfigModel):
    """``[checkpoint]``: when training state is saved and whether a run resumes from it."""

    dir: str = "checkpoints"
    """Folder for checkpoints, relative to the run folder (or absolute)."""
    every_steps: NonNegativeInt = 0
    """Save every this many optimiser steps; 0 saves only when training ends."""
    keep_last: NonNegativeInt = 2
    """How many recent checkpoints to keep; 0 keeps all of them."""
    resume: bool = False
    """Start from the latest checkpoint in `dir`, if there is one."""


class WandbConfig(ConfigModel):
    """``[logging.wandb]``: optional Weights & Biases logging."""

    enabled: bool = False
    """Send the trainer's metrics to Weights & Biases (needs the `wandb` package, and a login unless `WANDB_MODE=offline`; local files go to `wandb/` in the run folder)."""
    project: str | None = None
    """W&B project name; required when enabled."""
    entity: str | None = None
    """W&B team or user; unset means your default entity."""

    @model_validator(mode="after")
    def _project_when_enabled(self) -> WandbConfig:
        if self.enabled and not self.project:
            raise_one("project", "is required when logging.wandb.enabled is true")
        return self


class LoggingConfig(ConfigModel):
    """``[logging]``: what is logged and where metrics go."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level of log records that are shown."""
    format: Literal["auto", "console", "json"] = "auto"
    """Log format: "console" (readable), "json" (one object per line), or "auto" (console on a terminal, JSON otherwise)."""
    jsonl: bool = True
    """Write the trainer's metrics, one JSON object per step, to `metrics.jsonl` in the run folder (`relax status`, the TUI and the Prometheus trainer gauges read it)."""
    tensorboard: bool = False
    """Write the trainer's metrics for TensorBoard to `tensorboard/` in the run folder, one scalar per numeric metric per step (needs the `tensorboard` package: `pip install relax-rl[tensorboard]`)."""
    log_files: bool = True
    """Also write every log line, as JSON, to one file per actor in the run folder: `logs/<actor-id>.jsonl` (lines outside any actor: `logs/cluster.jsonl`), from every process; `relax logs` reads them."""
    prometheus: bool = True
    """Serve Prometheus metrics (trainer metrics, actor states and restarts, bus gauges and counters) at `http://127.0.0.1:PORT/metrics` from the cluster's main process; PORT is `cluster.ports.metrics` (0 picks a free one) and `relax status` shows the URL."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases settings."""
