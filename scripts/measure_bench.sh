#!/usr/bin/env bash
# Writes docs/data/bench-mid1g.md and docs/data/bench-mid1g.json: `k3 bench` (prefill/decode
# tokens/s at several context depths) on the generated ~1 GB K3-shaped mid1g checkpoint.
# The checkpoint is (re)generated when absent (needs the tools venv: tools/setup_venv.sh); never commit it.
# Environment: MODEL (default build/mid1g), BUILD_DIR (default build), PYTHON (default
# build/venv/bin/python), BENCH_ARGS (default below: sized for at most ~8 minutes on 2 cores).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=${MODEL:-build/mid1g}
build=${BUILD_DIR:-build}
py=${PYTHON:-build/venv/bin/python}
# mid1g has max_position_embeddings 4096, so depth + 128 must stay <= 4096.
args=${BENCH_ARGS:--p 128 -n 32 -d 0,1024,2048,3072 -r 3}

if [[ ! -f $model/model.safetensors.index.json ]]; then
  [[ -x $py ]] || bash tools/setup_venv.sh
  [[ -x $py ]] || py=build/venv/bin/python
  "$py" tools/gen/gen_tiny_checkpoint.py --preset mid1g --seed 1 --out "$model" --no-reference
fi
cmake -S . -B "$build" >/dev/null && cmake --build "$build" -j"$(nproc)" --target k3cli >/dev/null

mkdir -p docs/data
md=docs/data/bench-mid1g.md json=docs/data/bench-mid1g.json
machine="$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
load=$(cut -d' ' -f1-3 /proc/loadavg)
# Other processes on the cores take time from the run (the thread pool then shrinks its team): say so.
if awk -v l="${load%% *}" -v n="$(nproc)" 'BEGIN { exit !(l > n / 2) }'; then
  echo "measure_bench.sh: warning: load average $load on $(nproc) cores; results will be noisy" >&2
fi
start=$(date +%s)
# shellcheck disable=SC2086
out=$("$build/bin/k3" bench -m "$model" $args -t "$(nproc)" -o md --json-out "$json")
{
  echo "<!-- written by bash scripts/measure_bench.sh: k3 bench -m mid1g $args -t $(nproc); $machine; $(date -u +%F); load average before $load; wall $(( $(date +%s) - start )) s -->"
  echo
  echo "$out"
} > "$md"
cat "$md"
