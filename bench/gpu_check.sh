#!/usr/bin/env bash
# The GPU checks of the weight plane issue as one prepared script, for a machine with one or
# more NVIDIA GPUs (an H200 in the device tool): each check is timed and reported as
# `name = value` lines; the whole script stays under 8 minutes.
#
#   bash bench/gpu_check.sh            # on a GPU machine, in a checkout with the venv active
#   bash bench/gpu_check.sh --cpu      # the same plumbing on CPU (what CI machines can run)
#
# Checks: 1. the digits recipe with vLLM generating on CUDA and DeepSpeed (ZeRO-2) training on
# CUDA, the weights over the weight plane (a gloo group; CUDA tensors staged through the
# host); 2. bench/weights.py (the plane against the bus and memcpy); 3. the colocated one-GPU
# hand-off (vLLM asleep while the trainer steps, weights by CUDA IPC): not built yet, reported
# as such. Install first: pip install -e ".[vllm,deepspeed]" (CUDA builds of torch and vLLM).
set -u
cd "$(dirname "$0")/.."
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
START=$(date +%s)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

if [ "$MODE" = gpu ]; then
  python - <<'PY' || { echo "gpu_check = no CUDA device"; exit 1; }
import torch
assert torch.cuda.is_available(), "no CUDA device"
print(f"cuda_device = {torch.cuda.get_device_name(0)}")
print(f"cuda_devices = {torch.cuda.device_count()}")
PY
  ENGINE=(--set 'rollout.engine="vllm"' --set 'rollout.vllm.gpu_memory_utilization=0.3'
          --set 'rollout.vllm.enforce_eager=true')
else
  echo "cuda_device = none (--cpu: the plumbing only)"
  ENGINE=()
fi

# 1. A real run: generation and training on the device, weights over the plane.
t0=$(date +%s.%N)
timeout 300 python -m relax.cli up examples/digits/cluster.toml --run-dir "$OUT/run" \
  "${ENGINE[@]}" --set 'trainer.backend="deepspeed"' --set 'trainer.zero_stage=2' \
  --set 'trainer.steps=30' --set 'weights.transport="group"' > "$OUT/up.log" 2>&1
rc=$?
t1=$(date +%s.%N)
echo "recipe_exit = $rc"
echo "recipe_wall_s = $(python -c "print(round($t1 - $t0, 1))")"
python - "$OUT/run" <<'PY'
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
steps = [r for r in rows if r.get("applied")]
if steps:
    print(f"recipe_steps = {len(steps)}")
    print(f"recipe_step_wall_ms_median = {statistics.median(r['wall_s'] for r in steps) * 1e3:.1f}")
    print(f"recipe_reward_first5 = {statistics.mean(r['reward_mean'] for r in steps[:5]):.3f}")
    print(f"recipe_reward_last5 = {statistics.mean(r['reward_mean'] for r in steps[-5:]):.3f}")
logs = run / "logs"
joined = failed = 0
for path in logs.glob("*.jsonl"):
    for line in path.read_text().splitlines():
        event = json.loads(line).get("event", "")
        joined += event == "joined the weight group"
        failed += event.startswith("weight transfer failed")
print(f"weight_group_joins = {joined}")
print(f"weight_transfer_failures = {failed}")
PY
[ "$rc" = 0 ] || tail -n 30 "$OUT/up.log"

# 2. The plane against the bus and memcpy (CPU group; 50 MB and 1 GB, one and two receivers).
timeout 240 python bench/weights.py --rounds 1 2>/dev/null | grep " = "

# 3. The colocated one-GPU path.
echo "colocated_handoff = not built"
echo "gpu_check_wall_s = $(( $(date +%s) - START ))"
