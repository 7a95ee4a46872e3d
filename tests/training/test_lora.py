"""LoRA training (``[model.lora]``): only the adapters train, publish and checkpoint.

The base stays bit-identical through any number of steps, the optimiser holds the adapters and
nothing else, a publish is the adapter tensors alone (a fraction of the model's bytes), a
checkpoint holds the adapter in peft's layout and resumes bit for bit, a checkpoint of the
other kind is refused at ``model.lora``, and the merged export computes what base + adapter do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.config import AlgorithmConfig, LoraConfig, TrainerConfig
from relax.errors import ConfigError
from relax.models import (
    adapter_parameters,
    apply_lora,
    is_adapter_name,
    merge_lora,
    read_adapter,
)
from relax.replay import comparable_metrics
from relax.training import TorchBackend, make_backend
from tests.training.conftest import PAD, make_rows

pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=8.0)
TRAINER = {"lr": 1e-2, "micro_batch_size": 2, "global_batch_size": 4}


def _lora(model, lora: LoraConfig = LORA, **trainer) -> TorchBackend:
    backend = make_backend(
        TrainerConfig(**{**TRAINER, **trainer}), AlgorithmConfig(), model, PAD, 1.0, lora=lora
    )
    assert isinstance(backend, TorchBackend)
    return backend


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_only_the_adapters_train_and_are_published(load_model) -> None:
    backend = _lora(load_model())
    adapters = adapter_parameters(backend.model)
    base = {
        name: t.detach().clone()
        for name, t in backend.model.state_dict().items()
        if ".lora_" not in name
    }
    assert {id(p) for p in backend.optimizer.param_groups[0]["params"]} == {
        id(p) for p in adapters.values()
    }
    start = {name: p.detach().clone() for name, p in adapters.items()}
    for seed in (1, 2, 3):
        assert backend.step(make_rows(seed=seed)).applied
    after = backend.model.state_dict()
    assert all(torch.equal(after[name], t) for name, t in base.items())  # the base is frozen
    assert all(not torch.equal(adapters[name], start[name]) for name in adapters)  # B and A moved

    published = backend.state_dict_for_publish()
    assert set(published) == set(adapters) and all(is_adapter_name(n) for n in published)
    assert all(torch.equal(published[n], adapters[n].detach()) for n in published)
    full = load_model().state_dict()
    assert _nbytes(published) < 0.25 * _nbytes(full)


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_bit_identically(
    load_model, tmp_path: Path
) -> None:
    straight = _lora(load_model())
    straight.step(make_rows(seed=10))
    path = straight.save_checkpoint(tmp_path / "step-1")
    expected = straight.step(make_rows(seed=11))
    expected_adapter = straight.state_dict_for_publish()

    assert (path / "adapter_model.safetensors").is_file()
    assert (path / "adapter_config.json").is_file()
    assert not (path / "model.safetensors").exists()  # the frozen base is the model folder's
    saved, cfg, base = read_adapter(path)
    assert (cfg.rank, cfg.alpha) == (LORA.rank, LORA.alpha)
    assert sorted(cfg.target_modules) == sorted(LORA.target_modules)
    assert base is not None and Path(base).is_dir()
    assert set(saved) == set(expected_adapter)

    resumed = _lora(load_model())
    with torch.no_grad():  # other adapter values: the checkpoint must overwrite all of them
        for p in adapter_parameters(resumed.model).values():
            p.normal_()
    resumed.load_checkpoint(path)
    assert resumed.version == 1
    got = resumed.step(make_rows(seed=11))
    published = resumed.state_dict_for_publish()
    assert all(torch.equal(published[n], expected_adapter[n]) for n in expected_adapter)
    assert comparable_metrics(got.metrics) == comparable_metrics(expected.metrics)  # no timings


def test_peft_reads_the_checkpoint_and_the_merged_export_computes_the_same(
    load_model, tmp_path: Path
) -> None:
    from peft import PeftModel

    backend = _lora(load_model())
    for seed in (1, 2):
        backend.step(make_rows(seed=seed))
    path = backend.save_checkpoint(tmp_path / "step-2")
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    backend.model.eval()
    with torch.no_grad():
        want = backend.model(ids).logits

    with torch.no_grad():
        through_peft = PeftModel.from_pretrained(load_model(), str(path))(ids).logits
    assert torch.allclose(through_peft, want, atol=1e-6)

    files = merge_lora(backend.model.name_or_path, path, tmp_path / "merged")
    assert "config.json" in files and not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any(".lora_" in name for name in merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, want, atol=1e-5)


def test_a_checkpoint_of_the_other_kind_is_refused_at_model_lora(
    load_model, tmp_path: Path
) -> None:
    lora_ckpt = _lora(load_model()).save_checkpoint(tmp_path / "lora")
    full = TorchBackend(load_model(), TrainerConfig(**TRAINER), AlgorithmConfig(), pad_id=PAD)
    full_ckpt = full.save_checkpoint(tmp_path / "full")

    cases = [
        (full, lora_ckpt, "is not set, but the checkpoint holds a LoRA adapter"),
        (_lora(load_model()), full_ckpt, "is set, but the checkpoint holds full weights"),
        (_lora(load_model(), LoraConfig(rank=8)), lora_ckpt, "differs from the checkpoint's"),
    ]
    for backend, path, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            backend.load_checkpoint(path)
        assert [issue.path for issue in info.value.issues] == ["model.lora"]
        assert backend.version == 0


def test_adopt_takes_a_published_adapter_and_refuses_full_weights(load_model) -> None:
    source = _lora(load_model())
    source.step(make_rows(seed=4))
    fresh = _lora(load_model())
    fresh.adopt(1, source.state_dict_for_publish())
    assert fresh.version == 1
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            fresh.state_dict_for_publish().values(),
            source.state_dict_for_publish().values(),
            strict=True,
        )
    )
    with pytest.raises(ValueError, match="full weights cannot replace a LoRA adapter"):
        fresh.adopt(2, load_model().state_dict())
    assert fresh.version == 1


def test_target_modules_that_match_nothing_are_a_config_error(load_model) -> None:
    with pytest.raises(ConfigError, match="match no module") as info:
        apply_lora(load_model(), LoraConfig(target_modules=["attention"]))
    issue = info.value.issues[0]
    assert issue.path == "model.lora.target_modules" and "q_proj" in (issue.hint or "")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2])
def test_deepspeed_trains_the_same_adapter_and_resumes_exactly(
    load_model, tmp_path: Path, stage: int
) -> None:
    """ZeRO with LoRA: DeepSpeed gets the adapters only, steps as the torch backend does, and
    its checkpoint (frozen base left out) resumes exactly."""
    pytest.importorskip("deepspeed")

    def ds(model):
        cfg = TrainerConfig(backend="deepspeed", zero_stage=stage, **TRAINER)
        return make_backend(cfg, AlgorithmConfig(), model, PAD, 1.0, lora=LORA)

    reference, backend = _lora(load_model()), ds(load_model())
    for seed in (1, 2):
        want, got = reference.step(make_rows(seed=seed)), backend.step(make_rows(seed=seed))
        assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=1e-6)
    published = backend.state_dict_for_publish()
    assert set(published) == set(reference.state_dict_for_publish())
    assert all(is_adapter_name(name) for name in published)

    path = backend.save_checkpoint(tmp_path / "step-2")
    assert (path / "adapter_model.safetensors").is_file()
    expected = backend.step(make_rows(seed=3))
    resumed = ds(load_model())
    resumed.load_checkpoint(path)
    got = resumed.step(make_rows(seed=3))
    assert got.metrics["loss"] == expected.metrics["loss"]
    after, want_after = resumed.state_dict_for_publish(), backend.state_dict_for_publish()
    assert all(torch.equal(after[n], want_after[n]) for n in want_after)
