#!/usr/bin/env bash
# Issue 20 on the GPU machine, the two pieces built on 2026-12-05, on the K3-shaped gpu-bench checkpoint:
#  1. the FP8 trunk on the GPU: k3 bench decode (tg64, graphs) and prefill (pp512) with the bf16 trunk
#     and with --trunk-fp8, the roofline column of each (the FP8 step reads fewer bytes);
#  2. the hybrid placement's long prompts: pp2048 with --cpu-experts, the routed experts computed by
#     the CPU (--prefill-experts cpu), streamed to the GPU (gpu) and auto, beside all on the GPU.
# Run on the GPU machine after `bash scripts/cuda_test.sh` packed build-cuda-stage/cli.tar.xz here:
#   run(command="bash scripts/device_round.sh fp8prefill", carry=["build-cuda-stage/cli.tar.xz"])
# Writes $OUT (or build-cuda-stage/out): fp8-{bf16,fp8}.{md,json}, prefill-{allgpu,cpu,gpu,auto}.{md,json}.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
ckpt=${K3_GPU_BENCH_DIR:-/tmp/gpu-bench}
ensure_gpu_bench "$ckpt" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
bench() {  # bench NAME ARGS...
  local name=$1
  shift
  "$k3" bench -m "$ckpt" --device cuda --no-progress --json-out "$out/$name.json" "$@" >"$out/$name.md" 2>"$out/$name.log" ||
    { echo "$name failed:"; tail -5 "$out/$name.log"; return 1; }
  grep -E '^\| gpu-bench' "$out/$name.md"
}
bench fp8-bf16 -p 512 -n 64 -r 5 --graphs on
bench fp8-fp8 -p 512 -n 64 -r 5 --graphs on --trunk-fp8
bench prefill-allgpu -p 2048 -n 0 -r 3
for mode in cpu gpu auto; do
  bench "prefill-$mode" -p 2048 -n 0 -r 3 --cpu-experts --prefill-experts $mode
done
