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
    FrozenList,
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
from relax.config._roles import ChildConfig

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
    standby: bool = False
    """Keep one warm spare process per process-placed child (roles and both buses), started and with the role's modules imported: a crashed child restarts in it instead of a new interpreter (SIGKILL -> serving again: see docs/architecture.md, "Warm spares"), and a new spare is prepared at once. Costs one idle process per child, holding its imports' memory (about 0.3-0.5 GB with torch and transformers)."""


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
    """Seconds a consumer may hold rows without acknowledging them before they return to the queue. A role restarted by its supervisor takes back what its dead predecessor held at once, without waiting this out."""
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


# --------------------------------------------------------------------------- [weights]


class WeightsConfig(ConfigModel):
    """``[weights]``: how each published policy version reaches the rollouts (the weight plane)."""

    transport: Literal["group", "bus"] = "group"
    """"group": the trainer sends each version to the rollouts over a tensor group (gloo on CPU, NCCL between GPUs, CUDA IPC to rollouts on the trainer's own GPU: picked per group from where each rollout's engine is), bucket by bucket with a checksum each; the bus carries only the announcement and the commit, and serves the trainer's copy (written into the run folder) to rollouts that join later or whose transfer failed. "bus": every byte through the bus (slower; for a trainer that shares no file system with the bus, "group" falls back to it by itself)."""
    bucket_mb: PositiveInt = 64
    """Size, in MiB, of the buckets a version is sent in (one collective and one checksum each; the trainer's extra memory during a publish is about one bucket)."""
    join_timeout: Seconds = 10.0
    """Seconds every rollout has to join a newly formed group (a live one joins within a poll); one that does not (it died since its last poll) gets that version from the bus, and the next version forms the group without it."""
    timeout: Seconds = 30.0
    """Seconds a bucket may take to start moving on every rollout; one that does not make it gets that version from the bus."""
    stall_timeout: Seconds = 5.0
    """Seconds a moving bucket may make no progress before its receiver counts as gone (a rollout SIGKILLed mid-transfer); the trainer goes on, the others keep their version."""
    lease: Seconds = 10.0
    """Seconds after a rollout's last poll that it still counts as a receiver; a dead one leaves the group at the first version after its lease ran out."""
    overlap: Literal["auto", "on", "off"] = "auto"
    """Publish each version while the trainer takes and computes the next step, instead of before it (the weights are a copy, so the step cannot change them mid-publish); versions still commit in order, each with the ack of its rows. Only while the staleness bound is above 0: at 0 the next batch needs rollouts on the new version anyway, and a staleness-0 run stays the synchronous loop. Staleness is counted from the trainer's own version meanwhile, so the bound holds as without overlap. "auto": on when the trainer has a GPU (the transfer then runs beside the step's kernels); off on CPU, where the publish's copies and checksums take the same cores the step needs (measured 0.89-0.95x, bench/publish_overlap.py)."""
    local_file: Literal["auto", "on", "off"] = "auto"
    """Whether a rollout that can read the samples bus's weight files (the same machine, or a shared file system) reads each committed version there (every bucket checked against the trainer's checksum) instead of receiving it over the group, which then carries bytes only to the others. "auto": on for a rollout whose engine is on CPU (gloo over TCP is several times slower than a file in the page cache), off for one on a GPU (NCCL, or CUDA IPC on the trainer's own GPU, are faster than any file)."""


# --------------------------------------------------------------------------- [model]


MOE_ARCHS = ("qwen3_moe", "qwen3_omni_moe")
"""The ``[model.init] arch`` values whose decoder is a mixture of experts."""


class ModelInitConfig(ConfigModel):
    """``[model.init]``: a small randomly initialised model, built on the spot (no download)."""

    arch: Literal["qwen2", "llama", "qwen3_moe", "qwen2_5_omni", "qwen3_omni_moe"] = "qwen2"
    """Architecture: "qwen2" or "llama" (dense text), "qwen3_moe" (a Qwen3-MoE mixture of experts: every block's MLP is `num_experts` experts, `num_experts_per_tok` of them per token), "qwen2_5_omni" (a Qwen2.5-Omni thinker: text decoder of these sizes plus tiny vision and audio towers, with an offline processor for images, audio and video), or "qwen3_omni_moe" (a Qwen3-Omni-MoE thinker: the same towers and processor, and a mixture-of-experts text decoder whose experts are set as for "qwen3_moe")."""
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
    num_experts: PositiveInt = 8
    """Experts per MoE block ("qwen3_moe" and "qwen3_omni_moe" only)."""
    num_experts_per_tok: PositiveInt = 2
    """Experts each token is routed to, the router's top-k ("qwen3_moe" and "qwen3_omni_moe" only)."""
    moe_intermediate_size: PositiveInt | None = None
    """Width of each expert's hidden layer ("qwen3_moe" and "qwen3_omni_moe" only); unset: `intermediate_size`."""

    @model_validator(mode="after")
    def _shapes_fit(self) -> ModelInitConfig:
        problems = Problems()
        if self.num_experts_per_tok > self.num_experts:
            problems.add(
                "num_experts_per_tok",
                f"must be at most num_experts ({self.num_experts}), got {self.num_experts_per_tok}",
            )
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


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Qwen2/Llama decoder block (the output head excluded)."""


class LoraConfig(ConfigModel):
    """``[model.lora]``: train LoRA adapters instead of the whole policy (needs ``peft``).

    The base weights stay frozen: the optimiser holds only the adapters, and only they are
    published to the rollouts and saved in checkpoints.
    """

    rank: PositiveInt = 8
    """Rank r of each adapter: the update of a weight W (out x in) is B·A, A of r x in, B of out x r."""
    alpha: PositiveFloat = 16.0
    """The update is scaled by alpha / rank."""
    target_modules: FrozenList[str] = LORA_TARGETS
    """Names of the linear layers that get an adapter (matched against the end of each module's name, as peft does)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (0 keeps the trainer's log-probs equal to the rollout's)."""

    @field_validator("target_modules")
    @classmethod
    def _targets_named(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise value_error("must name at least one module", 'e.g. ["q_proj", "v_proj"]')
        if any(not name.strip() for name in value):
            raise value_error("must not contain an empty name")
        return value


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
    lora: LoraConfig | None = None
    """LoRA adapters trained on the frozen model (see `[model.lora]`); unset trains every weight."""

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

    estimator: Literal["k1", "k2", "k3", "abs", "mse", "low_var_kl"] = "k3"
    """KL estimator per token, with log r = log p_ref - log p (Schulman 2020): "k1" = -log r; "k2" = (log r)² / 2; "k3" = r - 1 - log r (unbiased and always ≥ 0); veRL's names: "mse" = k2, "abs" = |log r|, "low_var_kl" = k3 clamped to [-10, 10]."""
    coef: NonNegativeFloat = 0.0
    """Weight of the KL term; 0 turns it off (and above 0 needs `[reference] enabled = true`)."""
    mode: Literal["reward", "loss"] = "loss"
    """Where the penalty goes: subtracted from the reward per token, or added to the loss."""
    clamp: PositiveFloat | None = None
    """Bound each token's KL estimate to [-clamp, clamp], in both modes; unset clamps nothing (except "low_var_kl", always within [-10, 10])."""


class RolloutCorrectionConfig(ConfigModel):
    """``[algorithm.rollout_correction]``: correct for tokens sampled by another policy than the one trained (another engine or precision; older weights when staleness > 0).

    Computed from the ratio π_train / π_rollout of each counted token (the trainer's log-probs
    before this step's update against the rollout's). Importance weights (`is_*`) multiply each
    token's PPO loss; rejection rules (`reject_*`, and `is_mode = "mask"`) remove tokens or whole
    sequences. All keys unset: no correction. A correction that drops tokens or normalises by
    the batch costs one extra forward pass (without gradient) per step.
    """

    is_level: Literal["none", "token", "sequence", "geometric"] = "none"
    """Importance weights (only with loss = "ppo_clip"): "none"; "token" = each token's ratio (TIS); "sequence" = the product of the response's ratios; "geometric" = their geometric mean (exp of the mean log-ratio). A sequence-level weight applies to every token of its response."""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """What happens to large weights: "truncate" caps them at `is_high` (TIS); "mask" rejects the token ("token") or the whole sequence (otherwise) whose weight is outside [`is_low`, `is_high`] (masked IS, IcePop)."""
    is_high: PositiveFloat = 2.0
    """Cap of the weights ("truncate"), or upper bound of the kept band ("mask")."""
    is_low: PositiveFloat | None = None
    """Lower bound of the kept band, "mask" only; unset means 1 / `is_high`."""
    is_batch_normalize: bool = False
    """Divide the weights by their mean over the batch's kept tokens ("token") or kept sequences (otherwise), so they average exactly 1."""
    reject_token_low: PositiveFloat | None = None
    """Reject each token whose ratio is below this; unset: no lower bound."""
    reject_token_high: PositiveFloat | None = None
    """Reject each token whose ratio is above this; unset: no upper bound."""
    reject_seq_k1: PositiveFloat | None = None
    """Reject a whole sequence whose mean k1 (mean of log π_rollout - log π_train over its counted tokens) is above this; unset: off."""
    reject_seq_k3: PositiveFloat | None = None
    """Reject a whole sequence whose mean k3 (mean of r - 1 - log r, r = π_train / π_rollout) is above this; unset: off."""
    reject_geo_low: PositiveFloat | None = None
    """Reject a whole sequence whose geometric-mean ratio is below this; unset: no lower bound."""
    reject_geo_high: PositiveFloat | None = None
    """Reject a whole sequence whose geometric-mean ratio is above this; unset: no upper bound."""
    on_reject: Literal["drop", "zero_weight"] = "drop"
    """What a rejected token becomes: "drop" removes it from the loss mask, so it leaves the denominator of the policy loss, KL and entropy alike; "zero_weight" keeps it counted with weight 0 in the policy loss (loss = "ppo_clip" only; what off_policy = "icepop" does)."""

    @model_validator(mode="after")
    def _bounds_ordered(self) -> RolloutCorrectionConfig:
        problems = Problems()
        pairs = [
            ("reject_token_low", "reject_token_high"),
            ("reject_geo_low", "reject_geo_high"),
        ]
        if self.is_mode == "mask":
            pairs.append(("is_low", "is_high"))
        elif self.is_low is not None:
            problems.add("is_low", 'applies only to is_mode = "mask"', "unset it, or set is_mode")
        for low_key, high_key in pairs:
            low, high = getattr(self, low_key), getattr(self, high_key)
            if low is not None and high is not None and low >= high:
                problems.add(low_key, f"must be below {high_key} ({high:g}), got {low:g}")
        if self.is_mode == "mask" and self.is_low is None and self.is_high <= 1:
            problems.add("is_high", f'must be above 1 with is_mode = "mask", got {self.is_high:g}')
        problems.raise_if_any()
        return self


AGGREGATION_ALIASES = {"token": "token-mean", "sequence": "seq-mean-token-mean"}
"""The first names of `[algorithm] aggregation`, and the `loss_aggregation` each means."""


class AlgorithmConfig(ConfigModel):
    """``[algorithm]``: how advantages and the policy loss are computed (`docs/algorithms.md` has every formula and paper)."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """Advantage estimator: "grpo", "dr_grpo", "rloo" (group baselines), "reinforce_pp" (REINFORCE++), or "gae" (needs `[critic]`). A group of one gets advantage 0 from the group baselines (veRL's GRPO gives it its raw score)."""
    loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    """Policy loss: "ppo_clip" (token-level clipped ratio), "gspo" (sequence-level ratio; always aggregated "seq-mean-token-mean") or "cispo" (clipped importance weights)."""
    clip_low: float = Field(0.2, gt=0, allow_inf_nan=False)
    """Lower clip range: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, gt=0, allow_inf_nan=False)
    """Upper clip range: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher uses e.g. 0.28)."""
    dual_clip: float | None = Field(None, gt=1, allow_inf_nan=False)
    """Dual-clip constant c > 1 (Ye et al. 2020): the loss of a negative-advantage token is at most -c·A. Unset (the default) disables it; veRL applies it always with clip_ratio_c = 3.0, so set 3.0 to match."""
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number (policy loss, KL loss and entropy alike), veRL's modes: "token-mean" (over every counted token of the batch), "seq-mean-token-mean" (per sequence first, then over sequences), "seq-mean-token-sum" (each sequence's sum, averaged over sequences), "seq-mean-token-sum-norm" (Dr. GRPO: the batch's sum / (rows x `loss_norm_length`))."""
    loss_norm_length: PositiveFloat | None = None
    """The constant length of "seq-mean-token-sum-norm", in tokens (unused otherwise): each sequence's token sum is divided by it, then averaged over the batch's rows. Unset, a cluster.toml takes the generation budget `rollout.max_new_tokens`, as Dr. GRPO does (and veRL, whose default is the padded response length; veRL divides the sum by its loss_scale_factor alone: its f is rows x this)."""
    aggregation: Literal["token", "sequence"] | None = None
    """Former name of `loss_aggregation`: "token" = "token-mean", "sequence" = "seq-mean-token-mean". Unset unless you use it; set with a `loss_aggregation` of another meaning, it is an error."""
    kl: KLConfig = KLConfig()
    """The KL penalty against the reference model."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus; 0 turns it off."""
    off_policy: Literal["none", "tis", "icepop", "decoupled"] = "none"
    """Correction for the gap between the generating and the trained policy: none, truncated importance sampling, IcePop, or decoupled PPO. "tis" is `[algorithm.rollout_correction]` is_level = "token" with is_high = tis_cap; "icepop" is is_level = "token", is_mode = "mask", is_low = 1 / tis_cap, is_high = tis_cap, on_reject = "zero_weight"."""
    tis_cap: float = Field(2.0, gt=0, allow_inf_nan=False)
    """Cap of the importance weights used by off_policy "tis" and "icepop" (not by `[algorithm.rollout_correction]`: its cap is is_high)."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Importance weights and rejection sampling for off-policy tokens (see `[algorithm.rollout_correction]`)."""
    dynamic_sampling: bool = False
    """Drop groups whose samples all got the same reward (they carry no signal), as in DAPO."""
    gamma: Fraction = 1.0
    """Discount factor, used by "gae" and "reinforce_pp"."""
    lam: Fraction = 0.95
    """GAE's λ, trading bias for variance; used only by "gae"."""

    @model_validator(mode="before")
    @classmethod
    def _former_aggregation(cls, data: object) -> object:
        # `aggregation` keeps its meaning by filling in `loss_aggregation`; both given with
        # different meanings is refused rather than one silently winning.
        former = data.get("aggregation") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(former, str):
            return data
        meant = AGGREGATION_ALIASES.get(former)
        if meant is None:
            return data  # not a choice: the field's own check words the error
        given = data.get("loss_aggregation", meant)
        if given != meant:
            raise_one(
                "aggregation",
                f"{show(data['aggregation'])} means loss_aggregation = {show(meant)}, but"
                f" loss_aggregation = {show(given)} is set too",
                "keep only loss_aggregation",
            )
        return {**data, "loss_aggregation": meant}

    @model_validator(mode="after")
    def _parts_agree(self) -> AlgorithmConfig:
        problems = Problems()
        if self.loss_aggregation == "seq-mean-token-sum-norm" and self.loss_norm_length is None:
            problems.add(
                "loss_norm_length",
                'loss_aggregation "seq-mean-token-sum-norm" divides by a constant length,'
                " but none is set",
                "set loss_norm_length, e.g. to rollout.max_new_tokens",
            )
        rc = self.rollout_correction
        default = RolloutCorrectionConfig()
        changed = [
            key for key in type(rc).model_fields if getattr(rc, key) != getattr(default, key)
        ]
        if self.off_policy in ("tis", "icepop") and changed:
            problems.add(
                ("rollout_correction", changed[0]),
                f"conflicts with off_policy = {show(self.off_policy)}, which sets the"
                " importance weights itself",
                'use one of them: off_policy = "none" with the table, or drop the table',
            )
        elif rc.is_level != "none" and self.tis_cap not in (2.0, rc.is_high):
            problems.add(
                "tis_cap",
                f"is read only by off_policy tis and icepop; [algorithm.rollout_correction]"
                f" caps its weights at is_high ({rc.is_high:g})",
                "set rollout_correction.is_high instead",
            )
        if rc.is_level != "none" and (self.loss != "ppo_clip" or self.off_policy == "decoupled"):
            problems.add(
                ("rollout_correction", "is_level"),
                'importance weights need loss = "ppo_clip" without off_policy = "decoupled",'
                f" got loss = {show(self.loss)}, off_policy = {show(self.off_policy)}",
                'set is_level = "none" (rejection rules work with every loss)',
            )
        if rc.on_reject == "zero_weight" and (
            self.loss != "ppo_clip" or self.off_policy == "decoupled"
        ):
            problems.add(
                ("rollout_correction", "on_reject"),
                '"zero_weight" needs loss = "ppo_clip" without off_policy = "decoupled"',
                'use on_reject = "drop"',
            )
        problems.raise_if_any()
        return self


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


# --------------------------------------------------------------------------- [eval]


def _held_out_data() -> DataConfig:
    # Seed 1, unshuffled: the built-in task's prompts under other ids and another order than
    # training's seed 0 (it has only 100 distinct sums, so their texts do recur).
    return DataConfig(seed=1, shuffle=False)


class EvalConfig(ChildConfig):
    """``[eval]``: evaluation of the policy on held-out prompts while it trains.

    An evaluator (the child ``eval``, with its own engine) follows the published weights and
    evaluates version v when v is a multiple of ``every_steps``, and the final version; it
    never holds training up (a version it is too slow for is skipped, and counted).
    """

    shutdown: Shutdown | None = 120.0
    """Seconds it gets to stop when the run ends — the final evaluation runs then — before it is killed (the final record is then missing), or "brutal_kill"."""
    every_steps: NonNegativeInt = 0
    """Evaluate every this many trainer steps (policy versions; version 0 is the starting policy) and the final version; 0 turns evaluation off."""
    n_prompts: PositiveInt = 32
    """Held-out prompts per evaluation (the same ones every time: the first this many of `[eval.data]`)."""
    samples_per_prompt: PositiveInt = 4
    """Samples per prompt, k: pass@k is estimated from them; must be 1 with `greedy`."""
    greedy: bool = False
    """Decode greedily (temperature 0) instead of sampling at `temperature`: one sample per prompt."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature of evaluation (unused with `greedy`)."""
    max_new_tokens: PositiveInt | None = None
    """Most tokens per evaluation response; unset means `rollout.max_new_tokens`."""
    pass_threshold: float = 1.0
    """A sample is correct (for pass@1 and pass@k) when its reward is at least this; 1.0 is a full-credit answer of the built-in verifiers."""
    seed: int = 0
    """Sampling seed of evaluation: each prompt is seeded by it and its id, so every evaluation draws comparably."""
    data: DataConfig = Field(default_factory=_held_out_data)
    """Held-out prompts, as `[data]` describes prompts (file, generator or the built-in task; its `n_samples_per_prompt` is unused), except that `seed` defaults to 1 and `shuffle` to false here: the built-in task then gives other prompts (ids, order) than training's seed 0."""

    @field_validator("data", mode="before")
    @classmethod
    def _held_out_defaults(cls, value: object) -> object:
        # A written [eval.data] keeps the held-out seed and order unless it sets them.
        if isinstance(value, dict):
            return {"seed": 1, "shuffle": False, **value}
        return value

    def _collect_problems(self, problems: Problems) -> None:
        super()._collect_problems(problems)
        if self.greedy and self.samples_per_prompt != 1:
            problems.add(
                "samples_per_prompt",
                "greedy decoding gives one answer per prompt, so it must be 1, got"
                f" {self.samples_per_prompt}",
                "set greedy = false to sample k answers per prompt",
            )

    @property
    def enabled(self) -> bool:
        """Whether the evaluator runs."""
        return self.every_steps > 0
