#!/usr/bin/env bash
# GPU decode/prefill measurements for docs/data (run on the GPU machine, after
# `bash scripts/cuda_test.sh` staged the binaries here):
#   run(command="bash scripts/measure_cuda_perf.sh", carry=["build-cuda-stage"])
# Generates the K3-shaped gpu-bench checkpoint (~5 GB, tools/gen preset) on that machine, then
# `k3 bench --device cuda` in both numerics with CUDA graphs on and off, and on the bundled K3-nano.
# Writes to $OUT (or build-cuda-stage/out): cuda-bench-*.json + .md; the roofline columns are
# tg t/s x bytes a decode step reads / the device-copy bandwidth measured in the same run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-build-cuda-stage/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
k3=$root/build-cuda-stage/k3
ckpt=${K3_GPU_BENCH_DIR:-/tmp/gpu-bench}
if [[ ! -f $ckpt/config.json ]]; then
  t0=$(date +%s)
  python3 tools/gen/gen_tiny_checkpoint.py --preset gpu-bench --seed 1 --out "$ckpt" --no-reference >"$out/gen.log" 2>&1
  echo "generated gpu-bench in $(( $(date +%s) - t0 )) s: $(du -sh "$ckpt" | cut -f1)"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
for num in fast fp32; do
  "$k3" bench -m "$ckpt" --device cuda --numerics "$num" -p 512 -n 128 -d 0,4096 -r 5 --no-progress \
    --json-out "$out/cuda-bench-gpu-bench-$num.json" | tee "$out/cuda-bench-gpu-bench-$num.md"
done
"$k3" bench -m models/k3-nano --device cuda -p 512 -n 128 -r 5 --no-progress \
  --json-out "$out/cuda-bench-k3-nano-fast.json" | tee "$out/cuda-bench-k3-nano-fast.md"
