#!/usr/bin/env bash
# Issue 20's measurements on the GPU machine (tools/hybrid_check.py): k3 plan --calibrate there, the
# predicted decode t/s of the gpu, hybrid and cpu placements against k3 bench's measured ones, the
# hybrid step against max(GPU trunk, CPU experts), and the hot-expert cache at 25% and 50%.
# Run on the GPU machine after `bash scripts/cuda_test.sh` packed build-cuda-stage/cli.tar.xz here:
#   run(command="bash scripts/measure_hybrid.sh", carry=["build-cuda-stage/cli.tar.xz"])
# The model: the K3-shaped gpu-bench checkpoint (tools/gen preset, ~5 GB, generated there).
# Writes $OUT (or build-cuda-stage/out): hybrid-h200.json (-> docs/data/), and the log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
ckpt=/tmp/gpu-bench
ensure_gpu_bench "$ckpt" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONUNBUFFERED=1 python3 tools/hybrid_check.py --k3 "$k3" --model "$ckpt" --depth "${HYBRID_DEPTH:-512}" \
  --gen "${HYBRID_GEN:-64}" --threads "$(nproc)" --json "$out/hybrid-h200.json" 2>&1 | tee "$out/hybrid-h200.log"
