"""Relax against TRL's ``GRPOTrainer`` on the same model, task, group size and batch.

The work of one step is the same on both sides: the digits recipe's tiny Qwen2 (built from
``examples/digits/cluster.toml``'s ``[model.init]`` with ``relax.models.build_tiny_model``,
identical weights), the built-in one-digit additions (``relax.roles._prompts``), 4 prompts x 8
samples = 32 completions per step of at most ``rollout.max_new_tokens`` tokens, temperature 1,
GRPO advantages, PPO-clip loss with token aggregation, no KL, AdamW at a constant learning
rate, gradient clipping at 1. The reward is Relax's exact-match verifier on both sides (TRL
calls the very same verifier object as a reward function), scored where the samples were
generated (TRL's trainer; Relax's rollouts, ``[reward] in_rollout``).

- TRL 1.16: ``GRPOTrainer`` on CPU (``use_cpu``, no vLLM, fp32, gradient checkpointing off
  like Relax), in child processes: one process with each of ``--trl-threads`` torch thread
  counts (default 1 and 2), and ``--trl-processes`` data-parallel processes of one thread each
  (default 2: ``torch.distributed`` on gloo, the environment ``accelerate launch`` sets; each
  process generates and trains on half the completions). The fastest median is the baseline.
  (At this size a second intra-op thread buys little, and on a busy machine OpenMP's spinning
  threads can make it ten times slower.)
- Relax: real ``relax.cluster.run`` clusters, rollout and trainer in their own processes:
  at "inf" one of each with ``--relax-threads`` torch threads (default 1: a core each, both
  busy at once); at staleness 0, where generation and training take turns, each phase on both
  cores: two rollout processes of one thread and either a DeepSpeed ZeRO-0 trainer gang of two
  one-thread ranks (``DATA_PARALLEL``, ``relax-0-dp``) or one trainer process of two threads
  (``BOTH_CORES``, ``relax-0``); and, for comparison, one rollout and one trainer process with
  ``--relax-threads`` each (``relax-0-1r``). The DeepSpeed layout needs the ``deepspeed`` extra.

Time per step is measured after start-up on both sides: from the ``--warmup``-th optimiser
step to the last (TRL: a ``TrainerCallback.on_step_end`` clock; Relax: when each
``metrics.jsonl`` line appears). Configurations are repeated ``--rounds`` times, interleaved
(the order rotates each round), and medians compared. The last lines are machine-readable:
``sync_vs_trl = trl / relax staleness 0`` (its faster two-core layout) and
``async_vs_trl = trl / relax staleness inf`` (time per step; above 1 means Relax is faster),
after ``sync_threads_vs_trl``, ``sync_gang_vs_trl`` (each two-core layout) and
``sync_one_rollout_vs_trl`` (the one-rollout layout at staleness 0).

Setup, once (TRL must not go into the main venv; ``.venv-bench`` is its own):

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0        # the local CPU wheel, first
    .venv-bench/bin/pip install -e ".[deepspeed]"
    .venv-bench/bin/pip install -r bench/requirements-trl.txt

(Re-run ``pip install -e ".[deepspeed]"`` there whenever the project's dependencies change.)

Run: ``.venv-bench/bin/python bench/vs_trl.py [--rounds 3] [--steps 30] [--scale digits|scaled|100m]``
(about 4 minutes on 2 cores with the defaults; ``--scale scaled --steps 20`` about 6;
``--trl-threads 2 --trl-processes ""`` leaves out the slower TRL runs). Like every timing
here it wants an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (
    SCALES,
    Run,
    limit_threads,
    load_average,
    median,
    phase_line,
    quiet,
    recipe,
    timed_run,
)

# Both sides score with Relax's exact-match verifier (the digits recipe ships a format reward),
# in the process that generated the samples: TRL in its trainer, Relax in each rollout
# ([reward] in_rollout; no reward role).
EXACT_MATCH = (
    'reward.functions=[{name = "correct", kind = "exact_match"}]',
    "reward.in_rollout=true",
)


# At staleness 0 generation and training take turns, so each phase may have both cores (TRL's
# fastest run has two threads too): two rollout processes generate half a step each (two of
# the four prompts, one thread each), then the trainer steps on two threads. Bit-identical to
# `relax up --sync` all the same (tests/e2e/test_sync.py runs this layout).
BOTH_CORES = (
    "rollout.replicas=2",
    "rollout.batch_size=2",
    "rollout.threads=1",
    "trainer.threads=2",
)

# The same two rollouts, and the trainer as two data-parallel ranks of one thread (DeepSpeed
# ZeRO-0 over gloo, 16 rows each, gradients all-reduced). At these sizes a second intra-op
# thread speeds a training step up by about a tenth, a second rank by about a quarter
# (interleaved runs at the scaled size: gradient 108 against 124-135 ms). Still on-policy
# (staleness 0), but its sums are a 2-rank gang's, so it matches a gang's run, not the
# one-process `relax up --sync`.
DATA_PARALLEL = (
    *BOTH_CORES[:-1],
    'trainer.backend="deepspeed"',
    "trainer.zero_stage=0",
    "trainer.gang=2",
    "trainer.threads=1",
    "trainer.micro_batch_size=16",
)

LAYOUTS = {"relax-0": BOTH_CORES, "relax-0-dp": DATA_PARALLEL}


def relax_config(name: str, steps: int, scale: str) -> object:
    """``relax-0`` / ``relax-0-dp`` (staleness 0, both cores in each phase, see above),
    ``relax-0-1r`` (staleness 0, one rollout and one trainer process on a core each) or
    ``relax-inf``."""
    staleness = name.split("-")[1]
    return recipe(staleness, steps, scale, EXACT_MATCH + LAYOUTS.get(name, ()))


# --------------------------------------------------------------------------- TRL (child process)


def trl_worker(spec: dict) -> dict:
    """One TRL GRPO run; returns when each optimiser step ended (monotonic seconds)."""
    import itertools

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relax.models import build_tiny_model, load_policy
    from relax.rewards import BuildContext, build_verifier
    from relax.roles._prompts import prompt_stream

    torch.set_num_threads(spec["threads"])
    quiet()
    cfg = relax_config("relax-inf", spec["steps"], spec["scale"])
    n = cfg.data.n_samples_per_prompt
    prompts_per_step = cfg.trainer.global_batch_size // n
    work = Path(spec["dir"])
    model_dir = build_tiny_model(cfg.model.init, work / "model")
    model, tokenizer = load_policy(model_dir, cfg.trainer.dtype)
    model.train()
    items = list(
        itertools.islice(prompt_stream(cfg.data.model_dump()), prompts_per_step * 4 * spec["steps"])
    )
    dataset = Dataset.from_list([{"prompt": i["prompt"], "answer": i["answer"]} for i in items])
    verifier = build_verifier(
        cfg.reward.functions[0],
        BuildContext(answer_key="answer", max_response_tokens=cfg.rollout.max_new_tokens),
    )

    def exact_match(prompts: list, completions: list, answer: list, **_: object) -> list[float]:
        return [
            float(verifier(c, {"answer": a}, None))
            for c, a in zip(completions, answer, strict=True)
        ]

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.monotonic())

    args = GRPOConfig(
        output_dir=str(work / "out"),
        use_cpu=True,
        use_vllm=False,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=cfg.trainer.seed,
        max_steps=spec["steps"],
        # Completions per process: with N processes each generates and trains on 1/N of them.
        per_device_train_batch_size=cfg.trainer.global_batch_size // spec["processes"],
        ddp_backend="gloo" if spec["processes"] > 1 else None,
        gradient_accumulation_steps=1,
        num_generations=n,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        learning_rate=cfg.trainer.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.trainer.weight_decay,
        adam_beta1=cfg.trainer.betas[0],
        adam_beta2=cfg.trainer.betas[1],
        max_grad_norm=cfg.trainer.grad_clip,
        beta=0.0,  # no KL, no reference model (Relax: algorithm.kl.coef = 0)
        epsilon=cfg.algorithm.clip_low,
        loss_type="dapo",  # token-level aggregation (Relax: algorithm.aggregation = "token")
        scale_rewards="group",  # GRPO: (r - group mean) / group std
        dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL defaults to True; Relax does not recompute either
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    started = time.monotonic()
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"started": started, "stamps": stamps, "rewards": rewards}


def trl_layout(name: str) -> tuple[int, int]:
    """``(processes, threads)`` of a TRL configuration: ``trl-2t`` is one process of two
    threads, ``trl-2p`` two data-parallel processes (``torch.distributed`` on gloo, as
    ``accelerate launch`` would start them) of one thread each."""
    count, kind = int(name[4:-1]), name[-1]
    return (count, 1) if kind == "p" else (1, count)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trl_run(steps: int, scale: str, processes: int, threads: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="relax-bench-trl-") as tmp:
        spec = {"steps": steps, "scale": scale, "threads": threads, "processes": processes}
        spec["dir"] = tmp
        env = {**os.environ}
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(threads)
        # The environment `torchrun` / `accelerate launch` give each rank (one process: none).
        world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        world |= {"WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes)}
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--trl-worker", json.dumps(spec)],
                env=env | (world | {"RANK": str(r), "LOCAL_RANK": str(r)} if processes > 1 else {}),
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(processes)
        ]
        outs = [w.communicate()[0] for w in workers]
        if any(w.returncode for w in workers):
            raise RuntimeError(f"a TRL worker failed: exit codes {[w.returncode for w in workers]}")
    result = json.loads(outs[0].strip().splitlines()[-1])  # rank 0's clock and rewards
    records = [{"applied": True, "reward_mean": r} for r in result["rewards"]]
    records += [{"applied": True}] * (len(result["stamps"]) - len(records))
    return Run(result["started"], result["stamps"][-1], result["stamps"], records)


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> None:
    quiet()
    total = args.warmup + args.steps + 1
    trls = [f"trl-{t}t" for t in args.trl_threads] + [f"trl-{p}p" for p in args.trl_processes]
    relax = ("relax-0-dp", "relax-0", "relax-0-1r", "relax-inf")
    configs = (*trls, *relax)
    runs: dict[str, list[Run]] = {c: [] for c in configs}
    clock = time.monotonic()
    print(f"load average before: {load_average()}", flush=True)
    for r in range(args.rounds):
        shift = r % len(configs)
        for name in configs[shift:] + configs[:shift]:
            if name.startswith("trl-"):
                run = await asyncio.to_thread(trl_run, total, args.scale, *trl_layout(name))
            else:
                run = await timed_run(relax_config(name, total, args.scale))
            runs[name].append(run)
            print(
                f"round {r + 1}/{args.rounds} {name:>9}: "
                f"{run.period(args.warmup) * 1e3:6.1f} ms/step",
                flush=True,
            )
    print(f"load average after: {load_average()}; bench took {time.monotonic() - clock:.0f} s")
    per = {c: median([run.period(args.warmup) for run in runs[c]]) for c in configs}
    every = {c: [round(run.period(args.warmup) * 1e3, 1) for run in runs[c]] for c in configs}
    # The baseline is TRL at its best: the thread count with the lowest median.
    best = min(trls, key=lambda c: per[c])

    def reward(c: str) -> float:
        # Mean reward over each run's last quarter of steps (a sanity check, not a race).
        tails = []
        for run in runs[c]:
            values = [rec["reward_mean"] for _, rec in run.applied() if "reward_mean" in rec]
            tails += values[-max(1, len(values) // 4) :]
        return sum(tails) / len(tails) if tails else float("nan")

    scale = f" ({', '.join(SCALES[args.scale])})" if SCALES[args.scale] else ""
    print(
        f"\ndigits/{args.scale}{scale}; 4 prompts x 8 samples per step, exact-match reward;"
        f" median of {args.rounds} runs, {args.steps} timed steps each; Relax"
        f" {args.relax_threads} thread(s) in each of the rollout and trainer processes"
        " (staleness 0: two 1-thread rollouts, a trainer gang of two 1-thread ranks or a"
        " 2-thread trainer)"
    )
    labels = {"relax-0-dp": "Relax 0, gang of 2", "relax-0": "Relax 0, 2 threads"}
    labels |= {"relax-0-1r": "Relax 0, 1 rollout", "relax-inf": "Relax inf"}
    labels |= {c: "TRL, {} process(es) x {} thread(s)".format(*trl_layout(c)) for c in trls}
    for c in configs:
        print(
            f"{labels[c]:<20} {per[c] * 1e3:7.1f} ms/step  runs {every[c]}  "
            f"reward (last quarter) {reward(c):.3f}" + ("  <- TRL baseline" if c == best else "")
        )
    for c in relax:  # the trainer's phases: the next cost
        print(f"{labels[c]:<20} {phase_line(runs[c], args.warmup)}")
    # On-policy Relax at its best, like TRL: the faster of the two two-core layouts.
    sync = min(("relax-0-dp", "relax-0"), key=lambda c: per[c])
    print(f"trl_ms_per_step = {per[best] * 1e3:.1f}")
    print(f"relax_s0_ms_per_step = {per[sync] * 1e3:.1f}")
    print(f"relax_inf_ms_per_step = {per['relax-inf'] * 1e3:.1f}")
    print(f"sync_threads_vs_trl = {per[best] / per['relax-0']:.3f}")
    print(f"sync_gang_vs_trl = {per[best] / per['relax-0-dp']:.3f}")
    print(f"sync_one_rollout_vs_trl = {per[best] / per['relax-0-1r']:.3f}")
    print(f"sync_vs_trl = {per[best] / per[sync]:.3f}")
    print(f"async_vs_trl = {per[best] / per['relax-inf']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the clock")
    parser.add_argument("--scale", choices=tuple(SCALES), default="digits")
    parser.add_argument(
        "--trl-threads",
        type=lambda s: [int(t) for t in s.split(",")],
        default=[1, 2],
        help="torch thread counts to run TRL with in one process; the fastest is the baseline",
    )
    parser.add_argument(
        "--trl-processes",
        type=lambda s: [int(t) for t in s.split(",") if t],
        default=[2],
        help="data-parallel process counts (one thread each) to run TRL with too ('' for none)",
    )
    parser.add_argument("--relax-threads", type=int, default=1)
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        spec = json.loads(args.trl_worker)
        limit_threads(spec["threads"])
        print(json.dumps(trl_worker(spec)), flush=True)
        # No interpreter teardown: with several processes, gloo's threads abort (SIGABRT) or
        # hang (destroying the group first leaves DDP's reducer stuck in its destructor).
        os._exit(0)
    else:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            parser.error("trl is not installed here: run with .venv-bench/bin/python (see above)")
        if importlib.util.find_spec("deepspeed") is None:
            parser.error(
                'the gang layout needs DeepSpeed: pip install -e ".[deepspeed]" (see above)'
            )
        limit_threads(args.relax_threads)
        asyncio.run(main(args))
