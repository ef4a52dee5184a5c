#!/usr/bin/env bash
# CPU performance record (issue: CPU performance). Writes, from one run on an otherwise idle machine:
#   docs/data/cpu-roofline.md, cpu-roofline-run{1..5}.json, cpu-roofline-{fp32,avx2}.json:
#                                      k3 bench on the generated K3-shaped cpu-bench checkpoint
#                                      (BF16 trunk, MXFP4 experts, ~1.9 GB): decode and prefill with
#                                      the roofline ratio (bandwidth and peak bf16 FLOP/s probed in
#                                      the same run), fast numerics, plus fp32 numerics and the
#                                      avx2 level for comparison.
#   docs/data/k3-layer-bench.json      one true-width K3 layer of each kind (bin/k3_layer_bench),
#                                      extrapolated to 93 layers next to kimi-k3-in-c.
#   docs/data/cpu-gemv-bench.txt       the two decode weight streams alone (bin/k3_gemv_bench): BF16
#                                      GEMV rows split, MXFP4 experts, vs the probe.
#   docs/data/cpu-gemm-bench.txt       the prefill GEMMs alone (bin/k3_gemm_bench) at cpu-bench's
#                                      shapes, 1 and 2 threads, vs the peak probe.
# The checkpoint is (re)generated when absent (tools venv: tools/setup_venv.sh); never commit it.
# Environment: MODEL (default build/cpu-bench), BUILD_DIR (default build), PYTHON (default
# build/venv/bin/python), THREADS (default 2, the issue's setting).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=${MODEL:-build/cpu-bench}
build=${BUILD_DIR:-build}
py=${PYTHON:-build/venv/bin/python}
threads=${THREADS:-2}

if [[ ! -f $model/model.safetensors.index.json ]]; then
  [[ -x $py ]] || bash tools/setup_venv.sh
  [[ -x $py ]] || py=build/venv/bin/python
  "$py" tools/gen/gen_tiny_checkpoint.py --preset cpu-bench --seed 1 --out "$model" --no-reference
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)" --target k3cli k3_layer_bench k3_gemv_bench k3_gemm_bench >/dev/null

mkdir -p docs/data
machine="$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
load=$(cut -d' ' -f1-3 /proc/loadavg)
if awk -v l="${load%% *}" -v n="$(nproc)" 'BEGIN { exit !(l > n / 2) }'; then
  echo "measure_cpu_perf.sh: warning: load average $load on $(nproc) cores; results will be noisy" >&2
fi
start=$(date +%s)
k3="$build/bin/k3"
args="-p 128,512 -n 32 -r 3 -t $threads --no-progress"
md=docs/data/cpu-roofline.md
{
  echo "<!-- written by bash scripts/measure_cpu_perf.sh; $machine; $(date -u +%F); load average before $load -->"
  echo
  # The roofs move by tens of percent on a shared VM: k3 bench probes them again around every
  # repetition, and five independent runs are all recorded; docs quote the median ratio.
  for run in 1 2 3 4 5; do
    echo "### fast numerics (default), best CPU level: run $run of 5"
    echo
    # shellcheck disable=SC2086
    "$k3" bench -m "$model" $args --numerics fast -o md --json-out "docs/data/cpu-roofline-run$run.json"
    echo
  done
  echo
  echo "### fp32 numerics (SIMD kernels, no activation rounding)"
  echo
  # shellcheck disable=SC2086
  "$k3" bench -m "$model" $args --numerics fp32 -o md --json-out docs/data/cpu-roofline-fp32.json
  echo
  echo "### avx2 level (the fallback dispatch level), fast numerics"
  echo
  # shellcheck disable=SC2086
  "$k3" bench -m "$model" $args --cpu-isa avx2 -o md --json-out docs/data/cpu-roofline-avx2.json
} > "$md"
cat "$md"
{
  echo "# written by bash scripts/measure_cpu_perf.sh; $machine; $(date -u +%F); three runs, 2 threads"
  for run in 1 2 3; do OMP_NUM_THREADS=$threads "$build/bin/k3_gemv_bench" 2; done
} > docs/data/cpu-gemv-bench.txt
cat docs/data/cpu-gemv-bench.txt
{
  echo "# written by bash scripts/measure_cpu_perf.sh; $machine; $(date -u +%F)"
  OMP_NUM_THREADS=1 "$build/bin/k3_gemm_bench" 1
  OMP_NUM_THREADS=$threads "$build/bin/k3_gemm_bench" 1
} > docs/data/cpu-gemm-bench.txt
cat docs/data/cpu-gemm-bench.txt
OMP_NUM_THREADS=$threads "$build/bin/k3_layer_bench" -r 3 > docs/data/k3-layer-bench.json
cat docs/data/k3-layer-bench.json
echo "measure_cpu_perf.sh: wall $(( $(date +%s) - start )) s" >&2
