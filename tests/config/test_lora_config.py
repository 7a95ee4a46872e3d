"""``[model.lora]``: off by default, its defaults, and what the preflight refuses with it."""

from __future__ import annotations

import importlib.util

import pytest

from relax.config import LoraConfig, parse_config
from relax.preflight import preflight

MODEL = "[model.init]\n"
LORA = "[model.lora]\n"


def test_lora_is_off_by_default_and_its_table_turns_it_on() -> None:
    assert parse_config(MODEL).model.lora is None
    lora = parse_config(MODEL + LORA).model.lora
    assert lora == LoraConfig()
    assert (lora.rank, lora.alpha, lora.dropout) == (8, 16.0, 0.0)
    assert lora.target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


def test_vllm_refuses_what_it_cannot_serve_at_the_key(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(  # as if vllm and peft were installed, wherever this runs
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name in ("vllm", "peft") else real(name, *a),
    )
    vllm = '[rollout]\nengine = "vllm"\n'
    served = parse_config(MODEL + LORA + vllm)
    assert [i.path for i in preflight(served)] == []
    head = parse_config(
        MODEL + LORA + 'target_modules = ["q_proj", "lm_head"]\nrank = 1024\n' + vllm
    )
    issues = {i.path: i for i in preflight(head)}
    assert set(issues) == {"model.lora.rank", "model.lora.target_modules"}
    assert "lm_head" in issues["model.lora.target_modules"].message
    assert "512" in issues["model.lora.rank"].message
    # The HF engine serves both.
    assert (
        preflight(parse_config(MODEL + LORA + 'target_modules = ["lm_head"]\nrank = 1024\n')) == []
    )


def test_a_missing_peft_is_named_at_model_lora(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    issues = preflight(parse_config(MODEL + LORA))
    assert [i.path for i in issues] == ["model.lora"]
    assert "peft" in issues[0].message and "lora" in (issues[0].hint or "")


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ("rank = 0", "model.lora.rank"),
        ("alpha = 0", "model.lora.alpha"),
        ("dropout = 1.0", "model.lora.dropout"),
        ("target_modules = []", "model.lora.target_modules"),
        ('target_modules = [""]', "model.lora.target_modules"),
        ("ranks = 8", "model.lora.ranks"),
    ],
)
def test_bad_values_name_their_key(body: str, path: str) -> None:
    from relax.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_config(MODEL + LORA + body + "\n")
    assert [issue.path for issue in info.value.issues] == [path]
