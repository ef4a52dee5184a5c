#!/usr/bin/env bash
# Batched throughput record: `k3 bench -n 32 -b 1,8,32 -o json` (ppN and tgN for 1, 8 and 32
# sequences run together, each batch compared with the batch-1 row; docs/bench.md) on a K3-shaped
# benchmark checkpoint.
#   bash scripts/measure_batch.sh                CPU: the cpu-bench checkpoint (generated as
#                                                scripts/measure_cpu_perf.sh does, when absent)
#                                                -> docs/data/cpu-batch-bench.json
#   bash scripts/measure_batch.sh --device cuda  GPU machine: the gpu-bench checkpoint (generated as
#                                                scripts/measure_cuda_perf.sh does, when absent) and
#                                                the k3 of build-cuda-stage/cli.tar.xz (packed by
#                                                bash scripts/cuda_test.sh) -> docs/data/cuda-batch-bench.json,
#                                                copied to $OUT too; with the `device` tool:
#   run(command="bash scripts/measure_batch.sh --device cuda", carry=["build-cuda-stage/cli.tar.xz"])
#   and copy the file from $OUT into docs/data here.
# The file is an object: command (this script), machine, date, load_average_before, wall_s, and the
# bench json document under "bench" (its build.command is the exact k3 command). Never commit the
# checkpoints.
# Environment: MODEL (default build/cpu-bench, or $K3_GPU_BENCH_DIR / /tmp/gpu-bench with cuda),
# BUILD_DIR (default build; CPU), PYTHON (default build/venv/bin/python; CPU), K3 (a k3 binary to
# use instead), BENCH_ARGS (default "-n 32 -b 1,8,32"), OUT_JSON (default the docs/data file above).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
device=cpu
if [[ "${1:-}" == "--device" ]]; then device=${2:-}; shift 2 || true; fi
[[ $device == cpu || $device == cuda ]] || { echo "measure_batch.sh: --device cpu or cuda" >&2; exit 2; }
[[ $# -eq 0 ]] || { echo "measure_batch.sh: unexpected argument '$1' (only --device cpu|cuda)" >&2; exit 2; }
args=${BENCH_ARGS:--n 32 -b 1,8,32}

if [[ $device == cpu ]]; then
  model=${MODEL:-build/cpu-bench}
  build=${BUILD_DIR:-build}
  py=${PYTHON:-build/venv/bin/python}
  out_json=${OUT_JSON:-docs/data/cpu-batch-bench.json}
  if [[ ! -f $model/config.json ]]; then
    [[ -x $py ]] || bash tools/setup_venv.sh
    [[ -x $py ]] || py=build/venv/bin/python
    "$py" tools/gen/gen_tiny_checkpoint.py --preset cpu-bench --seed 1 --out "$model" --no-reference
  fi
  if [[ -z ${K3:-} ]]; then
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$build" -j"$(nproc)" --target k3cli >/dev/null
  fi
  k3=${K3:-$build/bin/k3}
else
  model=${MODEL:-${K3_GPU_BENCH_DIR:-/tmp/gpu-bench}}
  out_json=${OUT_JSON:-docs/data/cuda-batch-bench.json}
  if [[ -z ${K3:-} ]]; then
    bin=/tmp/k3-cuda-cli
    rm -rf "$bin" && mkdir -p "$bin" && xz -dc build-cuda-stage/cli.tar.xz | tar -C "$bin" -xf - ||
      { echo "measure_batch.sh: cannot unpack build-cuda-stage/cli.tar.xz (run bash scripts/cuda_test.sh first)" >&2; exit 2; }
    export LD_LIBRARY_PATH=$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  fi
  k3=${K3:-/tmp/k3-cuda-cli/k3}
  if [[ ! -f $model/config.json ]]; then
    t0=$(date +%s)
    python3 tools/gen/gen_tiny_checkpoint.py --preset gpu-bench --seed 1 --out "$model" --no-reference >/tmp/gen.log 2>&1 ||
      { tail -5 /tmp/gen.log; exit 1; }
    echo "measure_batch.sh: generated gpu-bench in $(($(date +%s) - t0)) s" >&2
  fi
  args="$args --device cuda"
fi

mkdir -p "$(dirname "$out_json")"
machine="$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
if [[ $device == cuda ]]; then
  machine="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) + $machine"
fi
load=$(cut -d' ' -f1-3 /proc/loadavg)
# Other processes on the cores take time from the run (the thread pool then shrinks its team): say so.
if [[ $device == cpu ]] && awk -v l="${load%% *}" -v n="$(nproc)" 'BEGIN { exit !(l > n / 2) }'; then
  echo "measure_batch.sh: warning: load average $load on $(nproc) cores; results will be noisy" >&2
fi
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
start=$(date +%s)
# shellcheck disable=SC2086
"$k3" bench -m "$model" $args -o json --no-progress >"$tmp"
wall=$(( $(date +%s) - start ))
# The header names the overrides the run had, so the file says exactly what wrote it.
script="bash scripts/measure_batch.sh"
[[ $device == cuda ]] && script="$script --device cuda"
for v in OUT_JSON K3 BENCH_ARGS MODEL; do
  if [[ -n ${!v:-} ]]; then script="$v='${!v}' $script"; fi
done
{
  printf '{\n  "command": "%s",\n' "${script//\"/\\\"}"
  printf '  "machine": "%s",\n  "date": "%s",\n  "load_average_before": "%s",\n  "wall_s": %d,\n  "bench": ' \
    "$machine" "$(date -u +%F)" "$load" "$wall"
  sed '2,$s/^/  /' "$tmp"
  printf '}\n'
} >"$out_json"
if [[ -n ${OUT:-} && $device == cuda ]]; then mkdir -p "$OUT" && cp "$out_json" "$OUT/"; fi
# The rows, for the log: test, batch, aggregate and per-sequence t/s, vs batch 1, roofline ratio.
python3 - "$out_json" <<'EOF' || true
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc["bench"]["results"]:
    rl = r.get("roofline", {})
    print(f'{r["test"]:<22} n_batch {r.get("n_batch", 1):>3}  {r["avg_ts"]:10.2f} t/s  '
          f'{r.get("per_seq_ts", r["avg_ts"]):9.2f} per seq  x{r.get("aggregate_vs_batch1", 1.0):6.2f}  '
          f'roofline {100 * rl.get("ratio", 0):5.1f}%')
EOF
echo "measure_batch.sh: wrote $out_json (wall $wall s)" >&2
