"""The supervised children of ``cluster.toml``: the six RL roles and user ``[[actors]]``.

Every child shares ``ChildConfig`` (placement, restart, shutdown, heartbeats, gang); roles add
``enabled``/``replicas`` and their own settings. As in ``_models``, the attribute
docstrings are the user documentation, and cross-key checks of one table live in its model.
"""

from __future__ import annotations

import math
import re
import string
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, field_validator, model_validator

from relax.config._base import (
    AsTuple,
    ConfigModel,
    Dtype,
    FrozenList,
    ImportPath,
    NonNegativeFloat,
    NonNegativeInt,
    OpenFraction,
    Placement,
    PositiveFloat,
    PositiveInt,
    Problems,
    Restart,
    SafeName,
    Seconds,
    Shutdown,
    import_path_problem,
    show,
    value_error,
)

ROLE_NAMES: tuple[str, ...] = ("dataset", "rollout", "reward", "reference", "critic", "trainer")
"""The built-in RL roles, each configured by the table of the same name."""

RESERVED_IDS: frozenset[str] = frozenset((*ROLE_NAMES, "bus", "supervisor"))
"""Child ids the cluster uses itself; user actors must pick others."""

Beta = Annotated[float, Field(ge=0, lt=1)]
"""One AdamW beta, in [0, 1)."""


# --------------------------------------------------------------------------- children


class RayOptions(ConfigModel):
    """``[<role>.ray]``: what one member of a child with placement "ray" reserves on its Ray node."""

    num_cpus: NonNegativeFloat = 1.0
    """Logical CPUs it reserves on its node (Ray's scheduling unit, not a limit on threads; see `threads`)."""
    num_gpus: NonNegativeFloat = 0.0
    """GPUs it reserves (fractions share one); Ray sets CUDA_VISIBLE_DEVICES for its process."""
    resources: dict[str, PositiveFloat] = {}
    """Custom Ray resources it needs, e.g. {"node-b" = 0.01} to pin it to the node started with that resource."""
    start_timeout: Seconds = 60.0
    """Seconds Ray gets to place and start it; a child no node can host within this fails to start."""
    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """Where a gang's members go (one Ray placement group per start of the gang): "STRICT_PACK" all on one node, "PACK" on as few nodes as fit, "SPREAD" across nodes where it can, "STRICT_SPREAD" each on a node of its own. A gang of one ignores it."""

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if builtin:
            raise value_error(
                f"{builtin[0]!r} is a built-in Ray resource, not a custom one",
                "use num_cpus / num_gpus for CPUs and GPUs",
            )
        return resources


class ChildConfig(ConfigModel):
    """Settings every supervised child has: where it runs and how it is restarted and watched."""

    placement: Placement = "inproc"
    """Where it runs: "inproc" (an asyncio task in the supervisor's process), "process" (its own OS process) or "ray" (its own process, started by a Ray actor on a node chosen by `[<role>.ray]`, a gang in one Ray placement group; needs `pip install -e ".[ray]"`)."""
    restart: Restart = "permanent"
    """When it is restarted: "permanent" (always), "transient" (only after a crash) or "temporary" (never)."""
    shutdown: Shutdown | None = None
    """Seconds it gets to stop cleanly before it is killed, or "brutal_kill"; unset means `[supervisor] shutdown`."""
    heartbeat_interval: Seconds = 2.0
    """Seconds between the heartbeats it sends to its supervisor."""
    heartbeat_timeout: Seconds = 30.0
    """Seconds without a heartbeat after which it is declared dead; must exceed `heartbeat_interval`."""
    gang: PositiveInt = 1
    """Number of processes that start, stop and restart together (e.g. trainer ranks); above 1 needs placement "process" or "ray"."""
    threads: PositiveInt | None = None
    """CPU threads torch may use in this child's process(es) (sets OMP_NUM_THREADS and MKL_NUM_THREADS); needs placement "process" or "ray". Unset leaves the library default (all cores): give roles that overlap their share of the cores instead."""
    ray: RayOptions = RayOptions()
    """What each member reserves on its Ray node, with placement "ray" (see `[<role>.ray]`)."""

    @model_validator(mode="after")
    def _child_checks(self) -> ChildConfig:
        problems = Problems()
        self._collect_problems(problems)
        problems.raise_if_any()
        return self

    def _collect_problems(self, problems: Problems) -> None:
        """Add this table's cross-key problems; subclasses extend it (and call super)."""
        if self.heartbeat_timeout <= self.heartbeat_interval:
            default = "" if "heartbeat_timeout" in self.model_fields_set else " (the default)"
            problems.add(
                "heartbeat_timeout",
                f"must be greater than heartbeat_interval ({self.heartbeat_interval:g} s),"
                f" got {self.heartbeat_timeout:g} s{default}",
                "a few missed heartbeats should be tolerated: use at least 3 times the interval",
            )
        if self.threads is not None and self.placement == "inproc":
            problems.add(
                "threads",
                'a thread budget needs the child in its own process: placement "process" or "ray",'
                ' but placement is "inproc"',
            )
        # Compared with the defaults, not "was it written": a dumped config restates them.
        if self.ray != RayOptions() and self.placement != "ray":
            problems.add(
                "ray",
                f'only applies with placement "ray", but placement is "{self.placement}"',
                'set placement = "ray", or remove the table',
            )
        ray = self.ray
        if (
            self.gang > 1
            and self.placement == "ray"
            and not (ray.num_cpus or ray.num_gpus or ray.resources)
        ):
            problems.add(
                ("ray", "num_cpus"),
                f"a gang of {self.gang} on Ray reserves one placement-group bundle per member,"
                " and a bundle cannot be empty: num_cpus, num_gpus and resources are all 0",
                "reserve something per member, e.g. num_cpus = 0.5",
            )
        if self.gang > 1 and self.placement == "inproc":
            problems.add(
                "gang",
                f'a gang of {self.gang} processes needs placement "process" or "ray",'
                ' but placement is "inproc"',
            )


class RoleConfig(ChildConfig):
    """Settings common to the built-in RL roles."""

    enabled: bool = True
    """Whether this role runs at all."""
    replicas: PositiveInt = 1
    """How many copies of this role run side by side (each one a gang of `gang` processes)."""


class DatasetConfig(RoleConfig):
    """``[dataset]``: the role that reads prompts (described by ``[data]``) and puts them on the bus."""


class VllmConfig(ConfigModel):
    """``[rollout.vllm]``: settings passed to vLLM when ``engine = "vllm"``."""

    gpu_memory_utilization: OpenFraction = 0.9
    """Fraction of each GPU's memory vLLM may claim for weights and KV cache (0 < x ≤ 1)."""
    tensor_parallel_size: PositiveInt = 1
    """Number of GPUs one vLLM engine shards the model over."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower, starts faster, easier to debug)."""
    max_model_len: PositiveInt | None = None
    """Longest sequence (prompt + response) the engine plans for; unset uses the model's limit."""
    enable_prefix_caching: bool = True
    """Reuse KV cache across requests sharing a prefix (the samples of one group share their prompt)."""
    seed: int = 0
    """Seed of vLLM's sampler."""


AgentKind = Literal["single", "env", "openai", "external"]


class AgentConfig(ConfigModel):
    """``[rollout.agent]``: what one sample is — one reply, a multi-turn episode of an environment, or a session of an agent program that talks to the rollout's OpenAI-compatible endpoint."""

    kind: AgentKind = "single"
    """"single": one reply per sample, scored by the reward role. "env": an episode of `env` (multi-turn, tool outputs masked out of the loss; the environment gives the reward). "openai": an episode of the agent program `program`, which only talks to the endpoint with the `openai` client; every call is recorded and the program returns the reward. "external": no prompts are taken; the user's own programs generate through the endpoint and submit finished sessions with their rewards."""
    env: ImportPath | None = None
    """For kind "env": import path "package.module:Name" of an `relax.agents.Env` subclass (or a factory returning one), called with `options` as keyword arguments, once per episode. Built-ins: "relax.agents.envs:GuessNumber", "relax.agents.envs:Calculator", "relax.agents.envs:ShapeQuest" (an image observation; needs a multimodal model)."""
    program: ImportPath | None = None
    """For kind "openai": import path of the agent program `fn(base_url, api_key, task, **options) -> reward`, sync (run in a thread) or async; it must only reach the policy through `base_url`."""
    options: dict[str, Any] = {}
    """Keyword arguments for `env` or `program` (free-form table)."""
    max_turns: PositiveInt = 4
    """Model replies per episode at most (kind "env")."""
    max_tokens: PositiveInt = 256
    """Tokens after the first prompt per episode at most, replies and observations together (kind "env"); each reply is also capped by `rollout.max_new_tokens`."""
    tool_timeout: Seconds = 10.0
    """Seconds one environment call (`reset`, `step`) may take; a slower one ends the episode as "tool_timeout" (kind "env")."""
    episode_timeout: Seconds = 300.0
    """Seconds one agent program may run (kind "openai"); a slower one ends as "tool_timeout" with what it recorded so far."""
    error_reward: float = Field(0.0, allow_inf_nan=False)
    """Reward of an episode a failing or hanging tool, environment or agent program ended (the reason is recorded in the row's `episode_reason`)."""
    observation_role: str = "tool"
    """Chat role of an environment's text observations."""
    chat: bool = True
    """Render episodes with the tokenizer's chat template; false appends plain text (for models without one)."""

    def needs_server(self) -> bool:
        """Whether this kind only works through the endpoint."""
        return self.kind in ("openai", "external")

    @model_validator(mode="after")
    def _kind_needs(self) -> AgentConfig:
        problems = Problems()
        if self.kind == "env" and self.env is None:
            problems.add("env", 'kind "env" needs env = "package.module:Name" (an Env class)')
        if self.kind == "openai" and self.program is None:
            problems.add("program", 'kind "openai" needs program = "package.module:function"')
        if not self.observation_role:
            problems.add("observation_role", "must not be empty")
        problems.raise_if_any()
        return self


class ServerConfig(ConfigModel):
    """``[rollout.server]``: the OpenAI-compatible endpoint (`/v1/chat/completions`, `/v1/completions`) a rollout serves on loopback; calls made in a session are recorded as trajectories."""

    enabled: bool = False
    """Serve the endpoint (always on for `agent.kind` "openai" and "external")."""
    host: str = "127.0.0.1"
    """Address to bind; keep it on loopback unless a firewall and the API key protect it."""
    port: NonNegativeInt = 0
    """Port of replica 0 (replica i serves port + i); 0 picks free ports. Each replica writes its URL to `RUN_DIR/endpoints/rollout-<i>.json`."""
    api_key_env: str | None = None
    """Environment variable holding the API key clients must send as a Bearer token; unset generates a random key per run (in the endpoint file, readable only by you)."""
    model_name: str = "policy"
    """The model name the endpoint serves (requests naming another get 404)."""
    max_sessions: PositiveInt = 4096
    """Open sessions kept at most; the least recently used beyond it are forgotten."""


class RolloutConfig(RoleConfig):
    """``[rollout]``: the role that generates responses with the current policy weights."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation backend: "hf" (Hugging Face `generate`, on `device`) or "vllm" (GPU)."""
    device: Device = "auto"
    """Where the "hf" engine runs: "auto" (the first GPU the replica sees, else the CPU), "cpu", "cuda" or "cuda:N". On the trainer's GPU (one GPU for both), published weights reach it by CUDA IPC, device to device. vLLM places itself."""
    max_new_tokens: PositiveInt = 64
    """Most tokens generated per response."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature; 0 means greedy (RL usually wants 1.0)."""
    top_p: OpenFraction = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p` (0 < p ≤ 1; 1 disables)."""
    top_k: NonNegativeInt = 0
    """Sample only among the `top_k` most likely tokens; 0 disables."""
    batch_size: PositiveInt = 8
    """Prompts one replica generates for at a time (each expands into `data.n_samples_per_prompt` samples)."""
    stop: FrozenList[str] = ()
    """Strings that end a response early (the stop string is kept in the response)."""
    weight_sync_timeout: Seconds = 60.0
    """Seconds a replica waits for new weights before the sync counts as failed."""
    seed: int | None = 0
    """Seed of sampling: each prompt's samples come from generators seeded by (seed, prompt id), so a run is reproducible and a retried prompt reproduces its samples; unset draws fresh randomness."""
    interruptible: bool = True
    """Let a weight update interrupt generation in flight (the rest of the response is generated with the new weights and per-token versions are recorded: HF between two tokens, vLLM between two engine steps with each request resumed from its prefix); if false, updates wait for the batch to finish."""
    schedule: Literal["batch", "shortest_first"] = "batch"
    """How a replica's batch reaches the bus. "batch": every group once the whole batch is generated. "shortest_first" (length-aware): the batch is ordered by each prompt's expected response length (what it took on earlier epochs; unseen prompts count as the mean), so the engine's decode chunks hold similar lengths, shortest first, and each group is put the moment its last sample ends, so the trainer's batches fill with the short groups while the long ones go on (with `interruptible`, under the newer weights as partial rollouts). Single-reply rollouts only; `relax up --sync` plays "batch"."""
    vllm: VllmConfig = VllmConfig()
    """vLLM engine settings; ignored unless `engine = "vllm"` (so switching engines needs no other edit)."""
    agent: AgentConfig = AgentConfig()
    """What one sample is: one reply, an environment episode or an agent session (see `[rollout.agent]`)."""
    server: ServerConfig = ServerConfig()
    """The OpenAI-compatible endpoint (see `[rollout.server]`)."""

    def serves(self) -> bool:
        """Whether replicas serve the OpenAI-compatible endpoint."""
        return self.server.enabled or self.agent.needs_server()

    def _collect_problems(self, problems: Problems) -> None:
        super()._collect_problems(problems)
        if self.schedule != "batch" and self.agent.kind != "single":
            problems.add(
                "schedule",
                f'"{self.schedule}" schedules single-reply rollouts; agent kind'
                f' "{self.agent.kind}" generates episodes or sessions: use "batch"',
            )
        if any(not stop for stop in self.stop):
            index = next(i for i, stop in enumerate(self.stop) if not stop)
            problems.add(("stop", index), "a stop string must not be empty")


RewardKind = Literal[
    "exact_match",
    "numeric",
    "math",
    "regex",
    "length_penalty",
    "python",
    "http",
    "reward_model",
    "judge",
]

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _device_form(value: str) -> str:
    if not _DEVICE.match(value):
        raise value_error(f'must be "auto", "cpu", "cuda" or "cuda:N", got {show(value)}')
    return value


Device = Annotated[str, AfterValidator(_device_form)]


class RewardModelConfig(ConfigModel):
    """``[reward.functions.model]``: the model a "reward_model" or "judge" function loads, once per reward replica (so `reward.placement` and `[reward.ray]` decide which GPU or node it sits on)."""

    path: str
    """Local Hugging Face model folder (config.json, weights, tokenizer). Kind "reward_model": a sequence-classification model with one label, whose logit on prompt + response is the score; kind "judge": a causal LM."""
    batch_size: PositiveInt = 16
    """Samples per forward pass (padded together); the role's batch (`reward.batch_size`) is scored in chunks of this many."""
    max_length: PositiveInt = 1024
    """Tokens the model reads at most per sample (prompt + response, or the judge's filled-in template); a longer text keeps its last `max_length` tokens, the end of the response."""
    dtype: Dtype = "float32"
    """Dtype the weights are loaded in: "float32", "bfloat16" or "float16"."""
    device: Device = "auto"
    """Where the model runs: "auto" (the first GPU the replica sees, else the CPU), "cpu", "cuda" or "cuda:N"."""


class JudgeConfig(ConfigModel):
    """``[reward.functions.judge]``: how a "judge" function prompts its model and reads a score from the reply (greedy decoding, so a sample always gets the same score)."""

    template: str
    """The rubric the judge is prompted with; `{prompt}` and `{response}` become the sample's prompt and response (write `{{` and `}}` for literal braces)."""
    score_pattern: str = r"Score: (\d+)"
    """Regular expression searched in the judge's reply; its first group is the score, a number. A reply it does not match fails the sample with the reply as the reason."""
    score_range: Annotated[tuple[float, float], AsTuple] = (0.0, 10.0)
    """[low, high] of the judge's scale: a score s counts (s - low) / (high - low), in [0, 1]; a score outside the range fails the sample."""
    max_new_tokens: PositiveInt = 32
    """Tokens the judge generates at most per reply."""

    @model_validator(mode="after")
    def _usable(self) -> JudgeConfig:
        problems = Problems()
        problem = _template_problem(self.template)
        if problem is not None:
            problems.add("template", problem)
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as exc:
            problems.add("score_pattern", f"is not a valid regular expression: {exc}")
        else:
            if groups < 1:
                problems.add("score_pattern", "needs a group around the score, e.g. (\\d+)")
        low, high = self.score_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            problems.add("score_range", f"must be [low, high] with low < high, got {[low, high]}")
        problems.raise_if_any()
        return self


def _template_problem(template: str) -> str | None:
    """Why ``template`` cannot be filled with a prompt and a response, or None."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        return f"is not a valid template: {exc} (write {{{{ and }}}} for literal braces)"
    unknown = sorted(fields - {"prompt", "response"})
    if unknown:
        return f"has unknown placeholders {unknown}: only {{prompt}} and {{response}} are filled"
    if "response" not in fields:
        return "has no {response} placeholder: the judge would never see the response"
    return None


class RewardFunctionConfig(ConfigModel):
    """``[[reward.functions]]``: one scoring function; a sample's reward is the weighted sum."""

    name: SafeName
    """Unique name of this function; its score is logged under it."""
    kind: RewardKind
    """What it computes: "exact_match" (answer equals the reference), "numeric" (answers equal as numbers), "math" (answers equal as mathematics, by math-verify: LaTeX, fractions, \\boxed{}), "regex" (response matches `pattern`), "length_penalty" (penalises long responses), "python" (calls `target`), "http" (POSTs to `target`), "reward_model" (a sequence-classification model's score, `[reward.functions.model]`) or "judge" (an LLM prompted with a rubric, its reply parsed to a score in [0, 1]: `[reward.functions.model]` and `[reward.functions.judge]`)."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Multiplier of this function's score in the total reward (may be negative)."""
    target: str | None = None
    """For kind "python": import path "package.module:function"; for kind "http": the http(s) URL. Unused otherwise."""
    pattern: str | None = None
    """For kind "regex": the Python regular expression a good response matches (searched, not anchored)."""
    timeout: Seconds = 10.0
    """Seconds one call may take before the sample's score counts as failed."""
    options: dict[str, Any] = {}
    """Extra keyword arguments passed to the function (free-form table)."""
    batched: bool = False
    """For kind "python": the function scores a whole batch in one call, `fn(responses, samples, **options)` returning one score per sample (what a reward model needs); it gets up to `reward.batch_size` samples and `timeout` is per call."""
    components: dict[SafeName, Annotated[float, Field(allow_inf_nan=False)]] = {}
    """For a function that returns a table of named scores (e.g. `{"correct": 1.0, "format": 0.5}`): the weight of each in the total (a name not listed weighs 1), times `weight`. Each is logged as `<name>/<component>`."""
    model: RewardModelConfig | None = None
    """For kinds "reward_model" and "judge": the model, loaded once by each reward replica."""
    judge: JudgeConfig | None = None
    """For kind "judge": the rubric template and how a score is read from the reply."""

    @model_validator(mode="after")
    def _kind_needs(self) -> RewardFunctionConfig:
        problems = Problems()
        kind = self.kind
        if self.batched and kind != "python":
            problems.add("batched", f'only kind "python" can be batched, not {show(kind)}')
        if kind == "python":
            if self.target is None:
                problems.add("target", 'kind "python" needs target = "package.module:function"')
            else:
                problem = import_path_problem(self.target)
                if problem is not None:
                    problems.add("target", *problem)
        elif kind == "http":
            if self.target is None:
                problems.add("target", 'kind "http" needs target = "https://host/path"')
            else:
                parts = urlsplit(self.target)
                if parts.scheme not in ("http", "https") or not parts.netloc:
                    problems.add(
                        "target",
                        f"must be an http:// or https:// URL, got {show(self.target)}",
                    )
        elif self.target is not None:
            problems.add("target", f'only kinds "python" and "http" use target, not {show(kind)}')
        if kind == "regex":
            if self.pattern is None:
                problems.add("pattern", 'kind "regex" needs a pattern')
            else:
                try:
                    re.compile(self.pattern)
                except re.error as exc:
                    problems.add("pattern", f"is not a valid regular expression: {exc}")
        elif self.pattern is not None:
            problems.add("pattern", f'only kind "regex" uses pattern, not {show(kind)}')
        self._model_tables(problems)
        problems.raise_if_any()
        return self

    def _model_tables(self, problems: Problems) -> None:
        kind = self.kind
        if kind in ("reward_model", "judge"):
            if self.model is None:
                problems.add("model", f"kind {show(kind)} needs a [reward.functions.model] table")
        elif self.model is not None:
            problems.add(
                "model", f'only kinds "reward_model" and "judge" use model, not {show(kind)}'
            )
        if kind == "judge":
            if self.judge is None:
                problems.add("judge", 'kind "judge" needs a [reward.functions.judge] table')
        elif self.judge is not None:
            problems.add("judge", f'only kind "judge" uses judge, not {show(kind)}')


_DEFAULT_REWARD = RewardFunctionConfig(name="correct", kind="exact_match")


class RewardConfig(RoleConfig):
    """``[reward]``: the role that scores responses; functions are ``[[reward.functions]]`` tables."""

    functions: FrozenList[RewardFunctionConfig] = (_DEFAULT_REWARD,)
    """The scoring functions; a sample's reward is the weighted sum of their scores. Unset means one exact-match function named "correct"."""
    batch_size: PositiveInt = 64
    """Samples the role takes from the bus and scores together (the most a batched function gets in one call)."""
    max_failed_groups: NonNegativeInt = 20
    """Consecutive groups whose reward failed (raised, timed out, or was not a finite number) after which the run stops with exit 1 and the function's traceback: a reward that always fails would otherwise drop every sample forever. 0 never stops."""
    in_rollout: bool = False
    """Score each sample in the rollout process that generated it, before it goes on the bus, with the same functions and the same rules (a failed reward drops its group; ``max_failed_groups`` stops the run): no reward role runs, and generation hands the trainer scored rows without a bus round trip through a reward process. For rewards that are cheap next to generation (the rule-based kinds); a slow or model-backed reward is better in its own role (the default), where it overlaps with generation and loads once."""

    def _collect_problems(self, problems: Problems) -> None:
        super()._collect_problems(problems)
        if self.enabled and not self.functions:
            problems.add("functions", "the reward role is enabled but has no functions")
        first_index: dict[str, int] = {}
        for index, function in enumerate(self.functions):
            if function.name in first_index:
                problems.add(
                    ("functions", index, "name"),
                    f"duplicate function name {show(function.name)}"
                    f" (also reward.functions[{first_index[function.name]}])",
                )
            else:
                first_index[function.name] = index


class ReferenceConfig(RoleConfig):
    """``[reference]``: the role that scores responses under the frozen initial policy (for the KL term)."""

    enabled: bool = False
    """Whether this role runs; needed when `algorithm.kl.coef` > 0."""
    model_path: str | None = None
    """Local Hugging Face model folder of the reference policy; unset means the `[model]` the policy starts from."""


class CriticConfig(RoleConfig):
    """``[critic]``: the value model, trained alongside the policy; needed by advantage "gae"."""

    enabled: bool = False
    """Whether this role runs; needed when `algorithm.advantage = "gae"`."""
    model_path: str | None = None
    """Local Hugging Face model folder the critic starts from; unset means the `[model]` of the policy (with a fresh value head)."""
    lr: float = Field(1e-5, gt=0, allow_inf_nan=False)
    """Learning rate of the critic's optimiser."""

    def _collect_problems(self, problems: Problems) -> None:
        super()._collect_problems(problems)
        if self.enabled and self.replicas > 1:
            # Each replica would train its own value model on a share of the rows: the values
            # of one batch would come from diverging critics.
            problems.add(
                "replicas",
                f"one critic is supported, got {self.replicas}",
                "set critic.replicas = 1",
            )


class TrainerConfig(RoleConfig):
    """``[trainer]``: the role that turns scored samples into policy updates and publishes weights."""

    backend: Literal["torch", "deepspeed"] = "torch"
    """Optimisation backend: "torch" (plain PyTorch, CPU or GPU) or "deepspeed" (ZeRO sharding)."""
    zero_stage: Literal[0, 1, 2, 3] | None = None
    """DeepSpeed ZeRO stage (0 to 3); only with backend "deepspeed", where unset means 2."""
    lr: float = Field(1e-5, gt=0, allow_inf_nan=False)
    """Learning rate of the policy optimiser (AdamW)."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    betas: Annotated[tuple[Beta, Beta], AsTuple] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    grad_clip: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Gradients are rescaled so their global norm is at most this."""
    micro_batch_size: PositiveInt = 4
    """Samples per forward/backward pass on one rank; gradients accumulate until `global_batch_size`."""
    sort_micro_batches: bool = True
    """Cut a step's rows into micro-batches longest first, so that each holds rows of similar length and is computed only up to its longest (padding is not): less compute when lengths spread, the longest micro-batch (the memory peak) first. The step's gradient is the same sum, up to float rounding. Off: the rows in the order they were taken."""
    max_sample_tokens: PositiveInt | None = None
    """Most tokens one sample may hold, prompt and response, media placeholders included (an image costs as many tokens as its processor gives it); the group of a larger sample is dropped as "oversized" (counted on the bus, never trained) instead of running a step out of memory. Unset: no limit."""
    global_batch_size: PositiveInt = 16
    """Samples per optimiser step, across all ranks; a multiple of `micro_batch_size` times `gang` and of `data.n_samples_per_prompt`."""
    steps: PositiveInt = 100
    """Optimiser steps to train for; each publishes a new policy version."""
    max_grad_norm_skip: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Skip (and count) a step whose gradient norm, before clipping, exceeds this; unset never skips."""
    seed: int = 0
    """Seed of the trainer's random state (initialisation, dropout)."""
    dtype: Dtype = "float32"
    """Precision of the trained weights: "float32", "bfloat16" or "float16"."""
    device: Device = "auto"
    """Where the "torch" backend trains: "auto" (the first GPU the replica sees, else the CPU), "cpu", "cuda" or "cuda:N". DeepSpeed takes its rank's GPU when there is one."""
    routing_replay: bool = False
    """R3 (Rollout Routing Replay) for a mixture-of-experts policy: every MoE layer of the trainer's (and the reference's) forward pass routes each token to the experts the rollout's routers chose for it (the `routed_experts` column the "hf" engine records), with gate weights recomputed from the trainer's own router logits at those experts, so the router still learns. Removes the training/inference mismatch that expert flips cause. Either way, each step logs `router_disagreement`: the fraction of recorded tokens (and layers) whose trainer-chosen experts differ from the recorded ones."""
    record: bool = True
    """Record what `relax replay` needs to re-execute this trainer exactly: each step's rows as the backend received them, how every (re)start began (checkpoint, adopted version), and a digest of the weights after each step — and, for `relax replay --regenerate`, each rollout's generate calls (prompts, seeds, decode batches, each token's weights version) — in the run folder's `record/` (its cost: docs/architecture.md, "Replay and the trainer's record")."""
    moe_aux_loss_coef: NonNegativeFloat = 0.0
    """Weight of a mixture-of-experts policy's load-balancing loss (Switch Transformer's, summed over MoE layers, on the experts actually used: the replayed ones under `routing_replay`) added to the RL loss; logged as `moe_aux_loss` whenever above 0."""

    def _collect_problems(self, problems: Problems) -> None:
        super()._collect_problems(problems)
        if self.zero_stage is not None and self.backend != "deepspeed":
            problems.add(
                "zero_stage",
                f'ZeRO stages need backend = "deepspeed", but backend is {show(self.backend)}',
            )
        if self.gang > 1 and self.backend != "deepspeed":
            problems.add(
                "gang",
                f'a trainer gang of {self.gang} ranks needs backend = "deepspeed",'
                f" but backend is {show(self.backend)}",
                'set trainer.backend = "deepspeed", or trainer.gang = 1',
            )
        step = self.micro_batch_size * self.gang
        if self.global_batch_size % step:
            factors = f"micro_batch_size ({self.micro_batch_size})"
            if self.gang > 1:
                factors = (
                    f"micro_batch_size * gang ({self.micro_batch_size} * {self.gang} = {step})"
                )
            problems.add(
                "global_batch_size",
                f"must be a multiple of {factors}, got {self.global_batch_size}",
            )

    @property
    def effective_zero_stage(self) -> int | None:
        """The ZeRO stage DeepSpeed runs with (None for the torch backend)."""
        if self.backend != "deepspeed":
            return None
        return 2 if self.zero_stage is None else self.zero_stage


# --------------------------------------------------------------------------- [[actors]]


class ActorConfig(ChildConfig):
    """``[[actors]]``: a user actor started in the supervisor tree next to the roles."""

    id: SafeName
    """Unique id of this actor in the tree; must not be a role name."""
    start: ImportPath
    """Import path "package.module:Class" of the actor class to start."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the actor class (free-form table)."""
