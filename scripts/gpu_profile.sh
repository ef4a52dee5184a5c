#!/usr/bin/env bash
# Where a GPU step's time goes (issue 19, goal 7), on the K3-shaped gpu-bench checkpoint:
#  1. `k3 bench --profile`: tg and pp t/s (graph replay for tg; pp512, and pp4096 in 512- and
#     4096-token steps), then the per-op table of one more
#     run in which every backend op is timed on the device (CUDA events; no graphs in that run);
#  2. Nsight Compute: every kernel of a few whole steps timed alone (gpu__time_duration), grouped
#     by kernel per step, for batch-1 decode, 32-sequence decode and a 512-token prefill. Their
#     sum against the step time of (1) is the share lost between kernels (launch gaps).
# Run on the GPU machine after `bash scripts/cuda_test.sh` packed build-cuda-stage/cli.tar.xz here:
#   run(command="bash scripts/gpu_profile.sh", carry=["build-cuda-stage/cli.tar.xz"])
# Writes $OUT (or build-cuda-stage/out): gpu-profile-bench.{md,json}, gpu-profile-pp4096-ub{512,4096}.{md,json},
# gpu-profile-kernels.{md,json}.
# K3_PROFILE_NUMERICS (default fast) picks the numerics; K3_SKIP_NCU=1 leaves out (2).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
ckpt=${K3_GPU_BENCH_DIR:-/tmp/gpu-bench}
ensure_gpu_bench "$ckpt" || exit 1
num=${K3_PROFILE_NUMERICS:-fast}
"$k3" bench -m "$ckpt" --device cuda --numerics "$num" -p 512 -n 64 -b 1,32 -r 3 --graphs on --profile --no-progress \
  --json-out "$out/gpu-profile-bench.json" >"$out/gpu-profile-bench.md" 2>&1 || { tail -20 "$out/gpu-profile-bench.md"; exit 1; }
head -12 "$out/gpu-profile-bench.md"
# Prefill of 4096 tokens (goal 3): in 512-token steps (the default --ubatch) and in one step.
for ub in 512 4096; do
  "$k3" bench -m "$ckpt" --device cuda --numerics "$num" -p 4096 -n 0 -r 3 --ubatch $ub --profile --no-progress \
    --json-out "$out/gpu-profile-pp4096-ub$ub.json" >"$out/gpu-profile-pp4096-ub$ub.md" 2>&1 ||
    { tail -20 "$out/gpu-profile-pp4096-ub$ub.md"; exit 1; }
  grep -E '^\| gpu-bench' "$out/gpu-profile-pp4096-ub$ub.md"
done
[[ "${K3_SKIP_NCU:-0}" == 1 ]] && exit 0
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[[ -x $ncu ]] || { echo "gpu_profile.sh: ncu not found"; exit 2; }
ids512=$(python3 -c "import random;r=random.Random(7);print(','.join(str(r.randrange(1,32000)) for _ in range(512)))")
python3 -c "import random;r=random.Random(8);[print(','.join(str(r.randrange(1,32000)) for _ in range(4))) for _ in range(32)]" >/tmp/ids32.txt
prof() {  # prof NAME ARGS...: the kernels of `k3 generate ARGS` timed by ncu, one csv
  local name=$1
  shift
  timeout "${K3_NCU_TIMEOUT:-150}" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    "$k3" generate -m "$ckpt" --device cuda --numerics "$num" "$@" >"/tmp/ncu-$name.csv" 2>"/tmp/ncu-$name.err" ||
    { echo "ncu $name failed"; tail -5 "/tmp/ncu-$name.err"; }
}
t0=$(date +%s)
prof decode1 --ids 17 -n 5
prof decode32 --ids-file /tmp/ids32.txt -n 4
prof prefill512 --ids "$ids512" -n 1
echo "ncu: $(($(date +%s) - t0)) s"
python3 tools/gpu_profile_table.py --bench "$out/gpu-profile-bench.json" \
  decode1=/tmp/ncu-decode1.csv decode32=/tmp/ncu-decode32.csv prefill512=/tmp/ncu-prefill512.csv \
  --json "$out/gpu-profile-kernels.json" | tee "$out/gpu-profile-kernels.md"
