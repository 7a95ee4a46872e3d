#!/usr/bin/env bash
# The GPU checks of the weight plane issue as one prepared script, for a machine with an
# NVIDIA GPU: each check is timed and reported as `name = value` lines; under 8 minutes.
#
#   bash bench/gpu_check.sh            # on a GPU machine, relax and its dependencies installed
#   bash bench/gpu_check.sh --cpu      # the same plumbing on CPU (what CI machines can run)
#
# Checks:
# 1. the CUDA tests of the weight plane (tests/bus/test_weight_plane_cuda.py: CUDA IPC to
#    receivers on the trainer's GPU, a receiver SIGKILLed mid-hand-off);
# 2. the one-GPU layout: the digits recipe with the torch trainer and the HF engine on the
#    same GPU (`device = "auto"`), versions handed over by CUDA IPC;
# 3. DeepSpeed (ZeRO-2) training on the GPU, with vLLM generating when it is installed (else
#    the HF engine on the GPU);
# 4. bench/weights.py with the state dicts on the GPU: CUDA IPC against a device-to-device
#    copy, and the host-staged routes.
# Install first: pip install -e ".[deepspeed]" (and ".[vllm]"), with CUDA builds of torch.
set -u
cd "$(dirname "$0")/.."
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
START=$(date +%s)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python}

if [ "$MODE" = gpu ]; then
  $PY - <<'PY' || { echo "gpu_check = no CUDA device"; exit 1; }
import torch
assert torch.cuda.is_available(), "no CUDA device"
print(f"cuda_device = {torch.cuda.get_device_name(0)}")
print(f"torch = {torch.__version__}")
PY
fi
if $PY -c "import vllm" 2>/dev/null; then VLLM=1; else VLLM=0; fi
echo "vllm_installed = $VLLM"

summary() {  # run folder, label: steps, step time, reward, the weight plane's routes
  $PY - "$1" "$2" <<'PY'
import json, statistics, sys
from pathlib import Path
run, label = Path(sys.argv[1]), sys.argv[2]
path = run / "metrics.jsonl"
rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
steps = [r for r in rows if "step" in r and "reward_mean" in r]
print(f"{label}_steps = {len(steps)}")
if steps:
    walls = [r["wall_s"] for r in steps if "wall_s" in r]
    if walls:
        print(f"{label}_step_ms_median = {statistics.median(walls) * 1e3:.1f}")
    print(f"{label}_reward_first5 = {statistics.mean(r['reward_mean'] for r in steps[:5]):.3f}")
    print(f"{label}_reward_last5 = {statistics.mean(r['reward_mean'] for r in steps[-5:]):.3f}")
routes, failed, devices = set(), 0, set()
for log in (run / "logs").glob("*.jsonl"):
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event", "")
        if name == "forming the weight group":
            routes.add(event.get("route"))
        failed += name.startswith("weight transfer failed")
print(f"{label}_weight_routes = {','.join(sorted(map(str, routes))) or 'none'}")
print(f"{label}_weight_transfer_failures = {failed}")
PY
}

# Trainer and rollout in processes of their own: CUDA IPC maps another process's memory.
PROCESSES=(--set 'trainer.placement="process"' --set 'rollout.placement="process"')

# 1. The weight plane's CUDA tests (skipped on CPU).
t0=$(date +%s)
timeout 200 $PY -m pytest -q -p no:cacheprovider tests/bus/test_weight_plane_cuda.py \
  tests/bus/test_plane_routes.py > "$WORK/tests.log" 2>&1
echo "cuda_tests_exit = $?"
echo "cuda_tests = $(tail -n 1 "$WORK/tests.log")"
echo "cuda_tests_s = $(( $(date +%s) - t0 ))"
grep -E "^(FAILED|ERROR)|Error" "$WORK/tests.log" | head -n 20

# 2. The one-GPU layout: trainer and HF engine on the same GPU.
t0=$(date +%s)
timeout 150 $PY -m relax.cli up examples/digits/cluster.toml --run-dir "$WORK/colocated" \
  "${PROCESSES[@]}" --set 'trainer.steps=30' > "$WORK/colocated.log" 2>&1
rc=$?
echo "colocated_exit = $rc"
echo "colocated_wall_s = $(( $(date +%s) - t0 ))"
summary "$WORK/colocated" colocated
[ "$rc" = 0 ] || tail -n 25 "$WORK/colocated.log"

# 3. DeepSpeed on the GPU (vLLM generating when installed).
ENGINE=()
[ "$VLLM" = 1 ] && [ "$MODE" = gpu ] && ENGINE=(--set 'rollout.engine="vllm"'
  --set 'rollout.vllm.gpu_memory_utilization=0.3' --set 'rollout.vllm.enforce_eager=true')
t0=$(date +%s)
timeout 180 $PY -m relax.cli up examples/digits/cluster.toml --run-dir "$WORK/deepspeed" \
  "${PROCESSES[@]}" "${ENGINE[@]}" --set 'trainer.backend="deepspeed"' --set 'trainer.zero_stage=2' \
  --set 'trainer.steps=20' > "$WORK/deepspeed.log" 2>&1
rc=$?
echo "deepspeed_exit = $rc"
echo "deepspeed_wall_s = $(( $(date +%s) - t0 ))"
summary "$WORK/deepspeed" deepspeed
[ "$rc" = 0 ] || tail -n 25 "$WORK/deepspeed.log"

# 4. The plane's speed with the weights on the GPU.
if [ "$MODE" = gpu ]; then
  timeout 150 $PY bench/weights.py --rounds 1 --device cuda --modes ipc,gloo 2>&1 | tail -n 20
else
  timeout 150 $PY bench/weights.py --rounds 1 --modes gloo 2>&1 | grep " = "
fi
echo "gpu_check_wall_s = $(( $(date +%s) - START ))"
if [ -n "${GPU_CHECK_LOGS:-}" ]; then  # keep the logs (the device tool's $OUT)
  cp "$WORK"/*.log "$GPU_CHECK_LOGS"/ 2>/dev/null
  tar czf "$GPU_CHECK_LOGS/run_logs.tgz" -C "$WORK" colocated/logs deepspeed/logs 2>/dev/null
fi
