#!/usr/bin/env bash
# Decode step time and memory against context for three layer maps of the same widths (issue 22):
# the released 3:1 KDA:MLA hybrid, all-MLA (full attention everywhere) and all-KDA, generated as
# tools/gen presets sweep-hybrid / sweep-mla / sweep-kda (hidden 512, 8 layers, K3's MLA latent of
# 512 + 64 values per token). Per map and depth: `k3 bench -p 0 -d DEPTH` (decode t/s with DEPTH
# tokens cached) and `k3 info --ctx DEPTH` (planned KDA state + MLA cache), then the plot.
#   bash scripts/context_sweep.sh                  CPU, this machine: depths 1K, 4K, 16K
#                                                   -> docs/data/context-sweep-cpu.json, docs/context-sweep-cpu.png
#   bash scripts/context_sweep.sh --device cuda    on the GPU machine (cli.tar.xz carried): depths 1K .. 1M,
#                                                   each depth context filled with seeded random values
#                                                   (k3 bench --depth-fill random: a 1M all-MLA prefill is
#                                                   quadratic) -> $OUT/context-sweep-cuda.json (+ .png)
# K3_SWEEP_DEPTHS overrides the depths (comma-separated), K3_SWEEP_FILL the fill (prefill | random),
# K3_SWEEP_DIR where the checkpoints go,
# K3_PY the Python that runs the generator (default: the tools venv, made by tools/setup_venv.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
device=cpu
[[ "${1:-}" == "--device" ]] && device=${2:?--device needs cpu or cuda}
dir=${K3_SWEEP_DIR:-/tmp/k3-context-sweep}
mkdir -p "$dir"
if [[ $device == cuda ]]; then
  source scripts/lib/device_cli.sh
  device_start
  py=python3
  depths=${K3_SWEEP_DEPTHS:-1024,4096,16384,65536,262144,1048576}
  fill=${K3_SWEEP_FILL:-random}
  json=$out/context-sweep-cuda.json
  png=$out/context-sweep-cuda.png
  plotpy=python3
else
  k3=${K3_BIN:-build-cpu/bin/k3}
  [[ -x $k3 ]] || { echo "context_sweep.sh: no $k3 (build first: cmake --build build-cpu)" >&2; exit 2; }
  py=${K3_PY:-build/venv/bin/python}  # the tools venv (numpy, torch): tools/setup_venv.sh
  [[ -n ${K3_PY:-} ]] || tools/setup_venv.sh >/dev/null
  depths=${K3_SWEEP_DEPTHS:-1024,4096,16384}
  fill=${K3_SWEEP_FILL:-prefill}
  json=docs/data/context-sweep-cpu.json
  png=docs/context-sweep-cpu.png
  [[ -x build/plotvenv/bin/python ]] || python3 -m venv build/plotvenv
  build/plotvenv/bin/python -m pip install -q --disable-pip-version-check -r tools/requirements-plot.txt
  plotpy=build/plotvenv/bin/python
fi
models=()
for map in hybrid mla kda; do
  [[ -f $dir/$map/config.json ]] ||
    "$py" tools/gen/gen_tiny_checkpoint.py --preset "sweep-$map" --seed 1 --out "$dir/$map" --no-reference >/dev/null
  models+=(--model "$map=$dir/$map")
done
python3 tools/context_sweep.py --k3 "$k3" "${models[@]}" --depths "$depths" --n 16 -r 3 --device "$device" \
  --depth-fill "$fill" --json "$json"
"$plotpy" tools/plot_context_sweep.py "$json" "$png" || echo "context_sweep.sh: no plot (matplotlib missing)"
echo "wrote $json and $png"
