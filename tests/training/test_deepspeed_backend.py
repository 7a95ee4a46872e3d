"""DeepSpeedBackend: ZeRO steps match TorchBackend, skips leave no trace, exact checkpoints.

World size 1 runs in this process (the backend makes its own one-rank gloo group); the
2-rank test starts two real processes (``ds_worker.py``) that meet on a loopback port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relax.config import AlgorithmConfig, TrainerConfig
from relax.errors import ConfigError
from relax.replay import comparable_metrics
from relax.training import DeepSpeedBackend, TorchBackend, make_backend
from tests.training.conftest import PAD, make_rows

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ds_worker.py")
TRAINER = {"lr": 1e-3, "micro_batch_size": 2, "global_batch_size": 4}


def _ds(model, stage: int = 2, **trainer) -> DeepSpeedBackend:
    cfg = TrainerConfig(backend="deepspeed", zero_stage=stage, **{**TRAINER, **trainer})
    return DeepSpeedBackend(model, cfg, AlgorithmConfig(), pad_id=PAD)


def _torch(model, **trainer) -> TorchBackend:
    return TorchBackend(
        model, TrainerConfig(**{**TRAINER, **trainer}), AlgorithmConfig(), pad_id=PAD
    )


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a nested optimiser state dict, by path."""
    if torch.is_tensor(obj):
        return {prefix: obj.detach().clone()}
    items = (
        obj.items()
        if isinstance(obj, dict)
        else enumerate(obj)
        if isinstance(obj, list | tuple)
        else ()
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def _poison(backend: DeepSpeedBackend):
    """Make every forward produce NaN logits (a broken kernel, an overflow)."""
    return backend.model.model.norm.register_forward_hook(lambda _m, _i, out: out * float("nan"))


def test_step_matches_torch_backend(load_model) -> None:
    reference, backend = _torch(load_model()), _ds(load_model())
    for seed in (1, 2):
        want, got = reference.step(make_rows(seed=seed)), backend.step(make_rows(seed=seed))
        assert got.applied and got.skipped_reason is None
        for key in ("loss", "grad_norm", "entropy", "tokens", "reward_mean"):
            assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-5), key
    assert backend.version == 2
    assert got.metrics["world_size"] == 1.0 and got.metrics["version"] == 2.0
    published = backend.state_dict_for_publish()
    expected = reference.state_dict_for_publish()
    assert published.keys() == expected.keys()  # Hugging Face names, tied ones included
    for name in expected:
        if name.endswith("k_proj.bias"):
            # A key bias adds q·b to every logit of a query; softmax cancels all of it but
            # what RoPE rotates, so its gradient is tiny, near Adam's eps, where Adam's
            # division turns float-level differences of the two backends' reductions into
            # visible ones (measured: 2.5e-7 of a 1.25e-3 move). It must stay within the
            # optimiser's reach of the reference; every other tensor matches to 1e-7.
            assert (published[name] - expected[name]).abs().max() <= 1e-3 * TRAINER["lr"]
            continue
        torch.testing.assert_close(published[name], expected[name], rtol=1e-5, atol=1e-7)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in published.values())


@pytest.mark.parametrize(
    ("stage", "dtype"),
    [(0, "float32"), (1, "float32"), (2, "float32"), (3, "float32"), (2, "bfloat16")],
)
def test_nan_loss_skip_leaves_no_trace(load_model, caplog, stage: int, dtype: str) -> None:
    """A skipped step changes nothing, and the next step is the one it would have been."""
    skipping, straight = (
        _ds(load_model(), stage, dtype=dtype),
        _ds(load_model(), stage, dtype=dtype),
    )
    for backend in (skipping, straight):
        assert backend.step(make_rows(seed=1)).applied  # AdamW state worth protecting
    weights = skipping.state_dict_for_publish()
    optimizer = _tensors(skipping.engine.optimizer.state_dict())
    handle = _poison(skipping)
    with caplog.at_level("WARNING", logger="relax.training"):
        result = skipping.step(make_rows(seed=2))
    handle.remove()
    assert not result.applied and result.skipped_reason == "non-finite loss (nan)"
    assert "training step skipped at version 1: non-finite loss" in caplog.text
    assert skipping.version == 1 and skipping.skipped_steps == 1
    assert _same(weights, skipping.state_dict_for_publish())
    assert _same(optimizer, _tensors(skipping.engine.optimizer.state_dict()))
    for backend in (skipping, straight):
        assert backend.step(make_rows(seed=3)).applied
    assert skipping.version == straight.version == 2
    assert _same(skipping.state_dict_for_publish(), straight.state_dict_for_publish())


@pytest.mark.parametrize("stage", [2, 3])
def test_exploding_grad_norm_skip_leaves_no_trace(load_model, stage: int) -> None:
    skipping, straight = _ds(load_model(), stage), _ds(load_model(), stage)
    weights = skipping.state_dict_for_publish()
    skipping.trainer_config = skipping.trainer_config.model_copy(
        update={"max_grad_norm_skip": 1e-6}
    )
    result = skipping.step(make_rows(seed=4))
    assert not result.applied and "above max_grad_norm_skip" in (result.skipped_reason or "")
    assert result.metrics["grad_norm"] > 1e-6
    assert skipping.version == 0 and _same(weights, skipping.state_dict_for_publish())
    # The skipped step's gradients must not leak into the next one.
    skipping.trainer_config = straight.trainer_config
    for backend in (skipping, straight):
        assert backend.step(make_rows(seed=5)).applied
    assert _same(skipping.state_dict_for_publish(), straight.state_dict_for_publish())


def test_non_finite_reward_skips_before_any_backward(load_model) -> None:
    backend = _ds(load_model())
    rows = make_rows()
    rows[1]["reward"] = float("inf")
    result = backend.step(rows)
    assert result.skipped_reason == "non-finite reward in rows [1]"
    assert backend.step(make_rows(seed=6)).applied


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_round_trip_is_exact(
    load_model, tmp_path: Path, monkeypatch, stage: int
) -> None:
    straight = _ds(load_model(), stage)
    straight.step(make_rows(seed=10))
    path = straight.save_checkpoint(tmp_path / "step-1")
    after_first = straight.state_dict_for_publish()
    expected = straight.step(make_rows(seed=11))
    expected_weights = straight.state_dict_for_publish()

    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert not list(tmp_path.glob(".*tmp"))  # the temp dir was renamed into place
    reloaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(reloaded[k], after_first[k]) for k in reloaded)

    # A differently initialised model proves the checkpoint really overwrites everything.
    torch.manual_seed(123)
    resumed = _ds(AutoModelForCausalLM.from_config(load_model().config), stage)
    loads = []
    real_load = torch.load

    def spy(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    resumed.load_checkpoint(path)
    monkeypatch.undo()
    assert loads and all(loads), "every checkpoint file is read with weights_only=True"
    assert resumed.version == 1
    got = resumed.step(make_rows(seed=11))
    assert got.applied and resumed.version == 2
    assert _same(expected_weights, resumed.state_dict_for_publish())
    assert comparable_metrics(got.metrics) == comparable_metrics(expected.metrics)  # no timings


def test_torch_checkpoint_loads_weights_with_fresh_optimizer(load_model, tmp_path: Path) -> None:
    torch_backend = _torch(load_model())
    torch_backend.step(make_rows(seed=12))
    path = torch_backend.save_checkpoint(tmp_path / "torch")
    backend = _ds(load_model())
    backend.load_checkpoint(path)
    assert backend.version == 1
    assert _same(backend.state_dict_for_publish(), torch_backend.state_dict_for_publish())


@pytest.mark.parametrize("stage", [2, 3])
def test_adopt_continues_from_published_weights(load_model, stage: int) -> None:
    trained = _torch(load_model())
    trained.step(make_rows(seed=13))
    trained.step(make_rows(seed=14))
    published = trained.state_dict_for_publish()
    backend = _ds(load_model(), stage)
    backend.step(make_rows(seed=15))  # AdamW moments that adopting must reset
    backend.adopt(trained.version, published)
    assert backend.version == 2
    assert _same(backend.state_dict_for_publish(), published)
    # Fresh moments: the next step equals a fresh backend's first step from these weights.
    fresh_model = load_model()
    fresh_model.load_state_dict(published)
    fresh = _torch(fresh_model)
    want = fresh.step(make_rows(seed=16))
    got = backend.step(make_rows(seed=16))
    assert got.applied and backend.version == 3
    assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=1e-6)
    after = backend.state_dict_for_publish()
    for name, tensor in fresh.state_dict_for_publish().items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        backend.adopt(5, {"not.a.weight": published[next(iter(published))]})


def test_make_backend_picks_by_config(load_model) -> None:
    algo = AlgorithmConfig()
    assert isinstance(make_backend(TrainerConfig(), algo, load_model(), PAD, 1.0), TorchBackend)
    deepspeed_cfg = TrainerConfig(backend="deepspeed", zero_stage=1)
    backend = make_backend(deepspeed_cfg, algo, load_model(), PAD, 1.0)
    assert isinstance(backend, DeepSpeedBackend) and backend.stage == 1
    with pytest.raises(ConfigError, match=r"trainer\.gang"):
        make_backend(TrainerConfig(), algo, load_model(), PAD, 1.0, world_size=2)


# --------------------------------------------------------------------------- two ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_rank_zero2_matches_one_process_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two real processes: identical weights on both ranks, equal to plain torch on the batch;
    a NaN on one rank only makes both ranks skip; a collective checkpoint resumes exactly."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(tiny_model_dir), str(tmp_path), "2"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=110)
        outputs.append(out)
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    weights = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert _same(weights[0], weights[1])  # every rank holds the same model
    for report in reports:
        assert [s["applied"] for s in report["steps"]] == [True, False, True]
        assert report["steps"][1]["skipped_reason"] == "non-finite loss (nan)"
        assert report["micro_batches"] == [[0, 2], [1, 3]][report["rank"]]
        assert all(s["world_size"] == 2.0 for s in report["steps"])
        assert report["resumed_exactly"] and report["resumed_version"] == 3
    checkpoint = Path(reports[0]["checkpoint"])
    assert len(list((checkpoint / "deepspeed").glob("*optim_states.pt"))) == 2  # one per rank
    assert (checkpoint / "rng-rank1.pt").is_file()

    # The same two healthy steps (micro-batches of 2) in one plain-torch process.
    reference = _torch(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        micro_batch_size=2,
        global_batch_size=8,
    )
    results = [reference.step(make_rows(groups, 2, seed=s)) for groups, s in ((4, 20), (3, 22))]
    for got, want in zip([reports[0]["steps"][0], reports[0]["steps"][2]], results, strict=True):
        for key in ("loss", "grad_norm", "entropy", "tokens", "rows"):
            assert got[key] == pytest.approx(want.metrics[key], rel=1e-5), key
    for name, tensor in reference.state_dict_for_publish().items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=1e-5, atol=1e-6)


def test_a_zero3_publish_gathers_one_weight_at_a_time(load_model, monkeypatch) -> None:
    """Under ZeRO-3 a publish never makes the whole model whole on a rank's device: each
    partitioned weight is gathered, copied out and released before the next."""
    import deepspeed

    backend = _ds(load_model(), 3)
    real = deepspeed.zero.GatheredParameters
    whole = {"now": 0, "peak": 0}

    class Counting:
        def __init__(self, params, **kwargs) -> None:
            self.numel = sum(p.ds_numel for p in params)
            self.inner = real(params, **kwargs)

        def __enter__(self) -> None:
            self.inner.__enter__()
            whole["now"] += self.numel
            whole["peak"] = max(whole["peak"], whole["now"])

        def __exit__(self, *exc) -> None:
            whole["now"] -= self.numel
            self.inner.__exit__(*exc)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", Counting)
    state = backend.state_dict_for_publish()
    sizes = [p.ds_numel for p in backend.model.parameters()]
    assert whole["peak"] == max(sizes) < sum(sizes)
    assert sum(t.numel() for t in state.values()) >= sum(sizes)  # and every weight came out


@pytest.mark.parametrize("stage", [0, 2])
def test_adamw_is_torchs_fused_one_like_the_torch_backend(load_model, stage: int) -> None:
    ds, plain = _ds(load_model(), stage=stage), _torch(load_model())
    inner = ds.engine.basic_optimizer  # under ZeRO's wrapper: the optimiser DeepSpeed built
    assert type(inner) is torch.optim.AdamW and inner.defaults["fused"] is True
    assert plain.optimizer.defaults["fused"] is True


AFTER_A_TORN_DOWN_WORLD = """
import json, sys
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from relax.config import AlgorithmConfig, TrainerConfig
from relax.training import DeepSpeedBackend
from tests.training.conftest import PAD, make_rows

def step():
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    cfg = TrainerConfig(backend="deepspeed", zero_stage=0, lr=1e-3, micro_batch_size=2,
                        global_batch_size=4)
    return DeepSpeedBackend(model, cfg, AlgorithmConfig(), pad_id=PAD).step(make_rows(seed=1))

first = step()
dist.destroy_process_group()  # through torch, as vLLM's cleanup does, not deepspeed.comm
second = step()
print(json.dumps([first.applied, second.applied, first.metrics["loss"], second.metrics["loss"]]))
"""


def test_an_engine_starts_after_the_world_was_torn_down_through_torch(
    tiny_model_dir: Path,
) -> None:
    """A process that trained, saw its torch.distributed world destroyed by other code (vLLM's
    cleanup, in CI's test worker) and trains again: DeepSpeed's clone of the old world is
    forgotten, so the new engine does not fail on an unregistered group. In a child process:
    the world is per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", AFTER_A_TORN_DOWN_WORLD, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, second, first_loss, second_loss = json.loads(out.stdout.splitlines()[-1])
    assert first and second
    assert second_loss == first_loss  # the same model and rows: the same step
