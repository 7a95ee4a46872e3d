"""Child process of ``test_build.py``: build models through Relax in several threads at once,
then report (one JSON line) whether transformers' process-wide state survived.

Run in its own process because, without Relax's building lock, the race leaves this process
unable to tie weights for good (it would poison every later test in a shared worker).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel

from relax.config import ModelInitConfig
from relax.models import build_tiny_model, load_policy
from relax.training import ValueModel

ROUNDS = 15


def main(folder: Path) -> None:
    tie_weights, init_weights = PreTrainedModel.tie_weights, PreTrainedModel.init_weights
    init = ModelInitConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, seed=0)
    tied = build_tiny_model(init, folder / "tied")
    # A checkpoint with tied embeddings (a real Qwen2.5-0.5B has them): lm_head is not saved.
    model = AutoModelForCausalLM.from_pretrained(tied)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tied)

    failures: list[str] = []

    def loop(build) -> None:
        try:
            for i in range(ROUNDS):
                build(i)
        except Exception as exc:  # reported, not raised: the parent reads the verdict
            failures.append(repr(exc))

    builders = [
        lambda i: load_policy(tied),  # what the rollout's engine and the reference load
        lambda i: load_policy(tied),
        lambda i: ValueModel.from_pretrained(tied),  # what the critic loads
        lambda i: build_tiny_model(init, folder / f"built-{i}"),  # from a config
    ]
    threads = [threading.Thread(target=loop, args=(build,)) for build in builders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    after, _ = load_policy(tied)
    print(
        json.dumps(
            {
                "failures": failures,
                "tie_weights_intact": PreTrainedModel.tie_weights is tie_weights,
                "init_weights_intact": PreTrainedModel.init_weights is init_weights,
                "lm_head_tied": after.lm_head.weight is after.model.embed_tokens.weight,
                "on_meta": [n for n, p in after.named_parameters() if p.device.type == "meta"],
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
