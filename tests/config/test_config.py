"""relax.config: the cluster.toml schema, its error reports, and key=value overrides."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from relax.config import (
    ROLE_NAMES,
    ClusterConfig,
    ClusterSection,
    ModelConfig,
    ModelInitConfig,
    apply_overrides,
    load_config,
    parse_config,
    validate_config,
)
from relax.config._locate import key_lines, locate
from relax.errors import ConfigError
from relax.preflight import load_checked

HERE = Path(__file__).parent
BAD_FILES = sorted((HERE / "bad").glob("*.toml"))
GOOD_FILES = sorted((HERE / "good").glob("*.toml"))
QUICKSTART = HERE.parents[1] / "examples" / "quickstart" / "cluster.toml"

MINIMAL = "[model.init]\n"


def _errors(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="test.toml")
    return info.value


def _directives(path: Path) -> dict[str, str]:
    """The leading `# expect: ...`, `# line: N`, `# hint: ...` comments of a bad file."""
    found: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        if not raw.startswith("# ") or ":" not in raw:
            break
        name, _, value = raw[2:].partition(":")
        found[name.strip()] = value.strip()
    return found


# --------------------------------------------------------------------------- files


def test_there_are_enough_bad_files():
    assert len(BAD_FILES) >= 18


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_file_is_rejected_at_the_expected_key(path: Path):
    directives = _directives(path)
    assert "expect" in directives, f"{path.name} needs a first line '# expect: <key.path>'"
    expected = "" if directives["expect"] == "<file>" else directives["expect"]

    # Every check `relax validate` and `relax up` run: the schema, then the preflight.
    with pytest.raises(ConfigError) as info:
        load_checked(path)
    issues = info.value.issues

    assert [issue.path for issue in issues] == [expected], "\n".join(map(str, issues))
    issue = issues[0]
    if "line" in directives:
        assert issue.line == int(directives["line"]), str(issue)
    if "hint" in directives:
        assert issue.hint is not None and directives["hint"] in issue.hint, str(issue)
    assert info.value.source == str(path)
    assert "Input should" not in issue.message  # pydantic's wording never reaches the user


@pytest.mark.parametrize("path", GOOD_FILES, ids=[p.stem for p in GOOD_FILES])
def test_good_file_parses(path: Path):
    config = load_config(path)
    assert isinstance(config, ClusterConfig)
    assert config.summary()


def test_good_gpu_file_values():
    config = load_config(HERE / "good" / "gpu_fully_async.toml")
    assert config.staleness == "inf"
    assert config.staleness_bound == math.inf
    assert config.trainer.effective_zero_stage == 3
    assert config.rollout.stop == ("</answer>",)
    assert [f.name for f in config.reward.functions] == ["correct", "format", "judge"]
    assert config.reward.functions[2].options == {"model": "judge-7b", "rubric": "math"}
    assert config.actors[0].kwargs == {"every_steps": 25, "split": "test"}
    assert config.shutdown_for(config.rollout) == "brutal_kill"
    assert config.shutdown_for(config.trainer) == 30.0  # inherited from [supervisor]
    assert config.bus_transport == "tcp"  # ray placement
    assert config.model.effective_tokenizer == "/models/Qwen2.5-1.5B-Instruct"
    assert config.data.source == "path"


def test_quickstart_example_is_valid_and_shows_the_defaults():
    config = load_config(QUICKSTART)
    expected = ClusterConfig(
        model=ModelConfig(init=ModelInitConfig()), cluster=ClusterSection(name="quickstart")
    )
    assert config == expected, "the quickstart should show every default (only the name differs)"


def _all_models(root: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    stack = [root]
    while stack:
        model = stack.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            for tp in _types_in(field.annotation):
                if isinstance(tp, type) and issubclass(tp, BaseModel):
                    stack.append(tp)
    return seen


def _types_in(tp: object) -> list[object]:
    found = [tp]
    for arg in typing.get_args(tp):
        found += _types_in(arg)
    return found


def test_every_field_has_a_docstring():
    models = _all_models(ClusterConfig)
    assert len(models) > 15
    undocumented = [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not undocumented, f"fields without a docstring: {undocumented}"


def test_every_key_appears_in_the_quickstart_example():
    text = QUICKSTART.read_text()
    missing = [
        f"{model.__name__}.{name}"
        for model in _all_models(ClusterConfig)
        for name in model.model_fields
        if f"{name} =" not in text and f"[{name}" not in text and f".{name}]" not in text
    ]
    assert not missing, f"document these keys in {QUICKSTART}: {missing}"


def test_every_model_is_strict_frozen_and_forbids_extra_keys():
    for model in _all_models(ClusterConfig):
        assert model.model_config.get("extra") == "forbid", model
        assert model.model_config.get("frozen") is True, model


# --------------------------------------------------------------------------- staleness


@pytest.mark.parametrize(
    ("value", "stored", "bound", "mode"),
    [
        ("0", 0, 0.0, "on-policy (0)"),
        ("1", 1, 1.0, "one-step off-policy (k=1)"),
        ("3", 3, 3.0, "bounded async (k=3)"),
        ('"inf"', "inf", math.inf, "fully async (inf)"),
        ("inf", "inf", math.inf, "fully async (inf)"),
        ("+inf", "inf", math.inf, "fully async (inf)"),
    ],
)
def test_staleness_normalises(value, stored, bound, mode):
    config = parse_config(f"staleness = {value}\n{MINIMAL}")
    assert config.staleness == stored
    assert config.staleness_bound == bound
    assert config.staleness_mode == mode
    assert mode in config.summary()


def test_staleness_defaults_to_one():
    assert parse_config(MINIMAL).staleness == 1


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("-1", "on-policy"),
        ("1.5", None),
        ("2.0", "without the '.0'"),
        ('"fast"', None),
        ('"Infinity"', 'write "inf"'),
        ("true", None),
        ("false", None),
        ("-inf", None),
        ("nan", None),
        ("[1]", None),
    ],
)
def test_staleness_rejects(value, hint):
    error = _errors(f"staleness = {value}\n{MINIMAL}")
    (issue,) = error.issues
    assert issue.path == "staleness"
    assert issue.line == 1
    assert issue.message.startswith('must be 0, a positive integer or "inf", got ')
    if hint:
        assert hint in (issue.hint or "")


# --------------------------------------------------------------------------- behaviour


def test_minimal_config_has_sensible_defaults():
    config = parse_config(MINIMAL)
    assert config.cluster.name == "relax"
    assert list(config.enabled_roles) == ["dataset", "rollout", "reward", "trainer"]
    assert list(config.roles) == list(ROLE_NAMES)
    assert config.reward.functions[0].kind == "exact_match"
    assert config.bus_transport == "inproc"
    assert config.model.effective_tokenizer == "byte"
    assert config.data.source == "builtin"
    assert config.shutdown_for(config.rollout) == config.supervisor.shutdown == 5.0
    assert config.supervisor.intensity == 1 and config.supervisor.period == 5.0


def test_bus_transport_auto_resolves_from_placements():
    text = MINIMAL + '[trainer]\nplacement = "process"\n'
    assert parse_config(text).bus_transport == "ipc"
    assert parse_config(text + '[bus]\ntransport = "tcp"\n').bus_transport == "tcp"


def test_config_is_frozen():
    config = parse_config(MINIMAL)
    with pytest.raises(ValidationError):
        config.staleness = 3  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.rollout.replicas = 3  # type: ignore[misc]


def test_strict_types_reject_coercions_but_accept_integers_for_floats():
    error = _errors(MINIMAL + '[rollout]\nreplicas = true\ntemperature = "0.5"\n')
    messages = {issue.path: issue.message for issue in error.issues}
    assert messages == {
        "rollout.replicas": "expected an integer ≥ 1, got true",
        "rollout.temperature": 'expected a number ≥ 0, got "0.5"',
    }
    assert parse_config(MINIMAL + "[rollout]\ntemperature = 1\n").rollout.temperature == 1.0


def test_array_items_and_missing_keys_are_phrased_clearly():
    text = MINIMAL + "[trainer]\nbetas = [0.9, 1.5]\n[[reward.functions]]\nname = 'a'\n"
    messages = {(issue.path, issue.line): issue.message for issue in _errors(text).issues}
    assert messages == {
        ("trainer.betas[1]", 3): "expected a number ≥ 0 and < 1, got 1.5",
        ("reward.functions[0].kind", 4): "missing required key 'kind'",
    }


def test_all_issues_are_reported_at_once_sorted_by_line():
    text = (
        "staleness = -3\n"  # 1
        "[rollout]\n"  # 2
        "replicas = 0\n"  # 3
        'placement = "thread"\n'  # 4
        "[trainer]\n"  # 5
        "lr = 0\n"  # 6
        "[model]\n"  # 7
    )
    error = _errors(text)
    assert [(issue.path, issue.line) for issue in error.issues] == [
        ("staleness", 1),
        ("rollout.replicas", 3),
        ("rollout.placement", 4),
        ("trainer.lr", 6),
        ("model", 7),
    ]
    assert "5 problems" in str(error)
    assert error.source == "test.toml"


def test_literal_error_lists_the_choices_and_guesses():
    error = _errors(MINIMAL + '[supervisor]\nstrategy = "one_for_al"\n')
    (issue,) = error.issues
    assert issue.message == (
        'must be one of "one_for_one", "rest_for_one" or "one_for_all", got "one_for_al"'
    )
    assert issue.hint == "did you mean 'one_for_all'?"


def test_unknown_key_without_a_close_match_lists_valid_keys():
    (issue,) = _errors(MINIMAL + "[checkpoint]\nzzz = 1\n").issues
    assert issue.message == "unknown key 'zzz'"
    assert issue.hint == "expected one of: dir, every_steps, keep_last, resume"


def test_wrong_table_type():
    (issue,) = _errors("rollout = 3\n" + MINIMAL).issues
    assert (issue.path, issue.message) == ("rollout", "expected a table, got 3")


def test_secret_is_never_echoed():
    config = parse_config(MINIMAL + '[cluster]\nsecret = "0123456789abcdef-secret"\n')
    assert "0123456789abcdef" not in config.model_dump_json()
    assert "0123456789abcdef" not in repr(config)
    assert config.cluster.secret is not None
    assert config.cluster.secret.get_secret_value() == "0123456789abcdef-secret"
    error = _errors(MINIMAL + '[cluster]\nsecret = "tiny-secret"\n')
    assert "tiny-secret" not in str(error)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_need_no_secret(host):
    assert parse_config(MINIMAL + f'[cluster]\nhost = "{host}"\n').cluster.host == host


def test_cross_section_checks():
    error = _errors(
        MINIMAL
        + "[data]\nn_samples_per_prompt = 1\n"
        + "[trainer]\nglobal_batch_size = 16\n"
        + "[bus]\ncapacity = 8\n"
    )
    assert [issue.path for issue in error.issues] == ["data.n_samples_per_prompt", "bus.capacity"]
    (issue,) = _errors(
        "[model.init]\nmax_position_embeddings = 100\n[rollout]\nmax_new_tokens = 64\n"
    ).issues
    assert issue.path == "model.init.max_position_embeddings"
    assert issue.line == 2


def test_model_validate_on_a_dict_raises_readable_validation_error():
    config = ClusterConfig.model_validate({"model": {"init": {}}, "staleness": 2})
    assert config.staleness == 2
    with pytest.raises(ValidationError) as info:
        ClusterConfig.model_validate({"model": {"init": {}}, "trainer": {"zero_stage": 1}})
    assert "zero_stage" in str(info.value) and "deepspeed" in str(info.value)


def test_validate_config_wraps_into_config_error_without_lines():
    with pytest.raises(ConfigError) as info:
        validate_config({"model": {"init": {"num_heads": 3, "num_kv_heads": 3}}})
    (issue,) = info.value.issues
    assert issue.path == "model.init.hidden_size"
    assert issue.line is None


def test_json_dump_round_trips():
    config = load_config(HERE / "good" / "processes_over_ipc.toml")
    dumped = json.loads(config.model_dump_json())
    assert dumped["staleness"] == "inf"
    assert ClusterConfig.model_validate(dumped) == config


def test_json_schema_can_be_generated():
    schema = ClusterConfig.model_json_schema()
    assert "staleness" in schema["properties"]


def test_importing_config_stays_light():
    code = (
        "import sys, relax.config\n"
        "heavy = [m for m in ('torch', 'transformers', 'relax.actors', 'relax.bus') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- reading files


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.issues[0].message == "no such file"
    assert str(tmp_path / "nope.toml") in str(info.value)


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match="folder"):
        load_config(tmp_path)


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(path)


def test_toml_syntax_error_reports_line_and_column():
    (issue,) = _errors('[model.init]\nseed = 1\nname = "unterminated\n').issues
    assert issue.path == ""
    assert issue.line == 3
    assert issue.message.startswith("invalid TOML: ")
    assert "column" in issue.message


def test_toml_duplicate_key_is_a_syntax_error():
    (issue,) = _errors("[model.init]\nseed = 1\nseed = 2\n").issues
    assert issue.line == 3


# --------------------------------------------------------------------------- line locator


def test_locator_handles_dotted_quoted_and_inline_keys():
    text = (
        "staleness = 1\n"  # 1
        'cluster."name" = "x"\n'  # 2
        "[rollout]\n"  # 3
        "vllm.seed = 3 # trailing comment with [fake] header\n"  # 4
        'stop = ["a", """multi\n'  # 5
        '[not_a_table]\n"""]\n'  # 6, 7
        "[cluster]\n"  # 8
        "ports = { control = 1, 'bus' = { x = [1, {y = 2}] } }\n"  # 9
        "[[reward.functions]]\n"  # 10
        'name = "a"\n'  # 11
        "[[reward.functions]]\n"  # 12
        'name = "b"\n'  # 13
        "[reward.functions.options]\n"  # 14
        "k = 1\n"  # 15
    )
    lines = key_lines(text)
    assert lines[("cluster", "name")] == 2
    assert lines[("rollout", "vllm", "seed")] == 4
    assert lines[("rollout", "stop", 1)] == 5
    assert ("not_a_table",) not in lines
    assert lines[("cluster", "ports", "bus", "x", 1, "y")] == 9
    assert lines[("reward", "functions", 0, "name")] == 11
    assert lines[("reward", "functions", 1, "name")] == 13
    assert lines[("reward", "functions", 1, "options", "k")] == 15
    assert locate(lines, ("reward", "functions", 1, "kind")) == 12  # falls back to the header
    assert locate(lines, ("nothing", "here")) is None


def test_locator_never_raises_on_garbage():
    assert isinstance(key_lines("[[[\n= = =\n'unterminated"), dict)


# --------------------------------------------------------------------------- overrides


def test_apply_overrides_sets_values_parsed_as_toml():
    data = {"rollout": {"replicas": 1}, "actors": [{"id": "a", "start": "m:A"}]}
    result = apply_overrides(
        data,
        [
            "rollout.replicas=4",
            "staleness=inf",
            "rollout.interruptible = false",
            "rollout.stop=['</s>', \"\\n\"]",
            "model.init.hidden_size=32",
            "model.path=/models/qwen",
            "cluster.name=run-7",
            'cluster.secret_env="RELAX_SECRET"',
            "actors[0].placement=process",
        ],
    )
    assert result["rollout"] == {
        "replicas": 4,
        "interruptible": False,
        "stop": ["</s>", "\n"],
    }
    assert math.isinf(result["staleness"])
    assert result["model"] == {"init": {"hidden_size": 32}, "path": "/models/qwen"}
    assert result["cluster"] == {"name": "run-7", "secret_env": "RELAX_SECRET"}
    assert result["actors"][0]["placement"] == "process"
    assert data == {"rollout": {"replicas": 1}, "actors": [{"id": "a", "start": "m:A"}]}


def test_later_overrides_win():
    assert apply_overrides({}, ["staleness=1", "staleness=2"]) == {"staleness": 2}


@pytest.mark.parametrize(
    ("override", "path", "fragment"),
    [
        ("rollout.replicas", "", "expected KEY=VALUE"),
        ("=3", "", "expected KEY=VALUE"),
        ("rollout..replicas=3", "rollout..replicas", "expected KEY=VALUE"),
        ("actors[x].id=a", "actors[x].id", "expected KEY=VALUE"),
        ("rollout.replicas=", "rollout.replicas", "has no value"),
        ("staleness.k=1", "staleness.k", "not a table"),
        ("actors[3].id=a", "actors[3].id", "does not exist"),
        ("rollout[0]=a", "rollout[0]", "not an array"),
        ("nothing[0].id=a", "nothing[0].id", "does not exist"),
    ],
)
def test_malformed_overrides(override, path, fragment):
    data = {"staleness": 1, "rollout": {}, "actors": [{"id": "a"}]}
    with pytest.raises(ConfigError) as info:
        apply_overrides(data, [override])
    (issue,) = info.value.issues
    assert issue.path == path
    assert fragment in issue.message
    assert repr(override) in issue.message


def test_all_malformed_overrides_are_reported_together():
    with pytest.raises(ConfigError) as info:
        apply_overrides({}, ["a", "b=", "c.d=1"])
    assert len(info.value.issues) == 2


def test_load_config_with_overrides_points_at_the_override(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(MINIMAL + "[rollout]\nreplicas = 2\n")
    assert load_config(path, overrides=["rollout.replicas=3"]).rollout.replicas == 3
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=["rollout.replicas=0"])
    (issue,) = info.value.issues
    assert issue.path == "rollout.replicas"
    assert issue.line is None
    assert issue.hint == "set by override 'rollout.replicas=0'"
