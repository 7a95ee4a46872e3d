"""One rank of the 2-process DeepSpeed test: ``python ds_worker.py MODEL_DIR OUT_DIR STAGE``.

Started by ``test_deepspeed_backend.py`` with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` set. Runs three steps (micro-batches of 2): a healthy one on 8 rows, one whose
forward is NaN on rank 1 only (both ranks must skip), a healthy one on 6 rows. Writes this rank's
weights (``rank{r}.safetensors``) and step results (``rank{r}.json``) to OUT_DIR, then saves a
collective checkpoint there and checks that a second engine resumes from it exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from relax.config import AlgorithmConfig, TrainerConfig
from relax.training import DeepSpeedBackend
from tests.training.conftest import PAD, make_rows


def main() -> None:
    model_dir, out_dir, stage = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    config = TrainerConfig(
        backend="deepspeed",
        zero_stage=stage,
        lr=1e-3,
        micro_batch_size=2,
        global_batch_size=8,
        gang=2,
        placement="process",
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = DeepSpeedBackend(model, config, AlgorithmConfig(), pad_id=PAD)
    steps = []
    for seed in (20, 21, 22):
        handle = None
        if seed == 21 and backend.rank == 1:
            handle = backend.model.model.norm.register_forward_hook(
                lambda _m, _i, out: out * float("nan")
            )
        # The last batch has 6 rows: 3 micro-batches, so rank 1 runs a stand-in in round 2.
        result = backend.step(make_rows(3 if seed == 22 else 4, 2, seed=seed))
        if handle is not None:
            handle.remove()
        steps.append(
            {"applied": result.applied, "skipped_reason": result.skipped_reason, **result.metrics}
        )
    weights = backend.state_dict_for_publish(every_rank=True)
    save_file(weights, str(out_dir / f"rank{backend.rank}.safetensors"))

    # A collective checkpoint, resumed by a second engine in the same world: same next step.
    path = backend.save_checkpoint(out_dir / "checkpoint")
    backend.step(make_rows(4, 2, seed=23))
    torch.manual_seed(123)
    resumed = DeepSpeedBackend(
        AutoModelForCausalLM.from_config(model.config), config, AlgorithmConfig(), pad_id=PAD
    )
    resumed.load_checkpoint(path)
    resumed.step(make_rows(4, 2, seed=23))
    continued = backend.state_dict_for_publish(every_rank=True)
    again = resumed.state_dict_for_publish(every_rank=True)
    report = {
        "rank": backend.rank,
        "micro_batches": backend._micro_batch_schedule(4),
        "steps": steps,
        "checkpoint": str(path),
        "resumed_version": resumed.version,
        "resumed_exactly": all(torch.equal(continued[k], again[k]) for k in continued),
    }
    (out_dir / f"rank{backend.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
