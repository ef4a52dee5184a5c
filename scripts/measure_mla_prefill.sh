#!/usr/bin/env bash
# MLA prefill on the CPU, absorbed vs the tiled expanded form (MlaAlgo::Auto's choice for prefill):
#   1. bin/k3_ops_bench (the op alone: 512 queries over 4,096 cached tokens, 16 heads, fp32 and fast
#      numerics, every SIMD level) -> docs/data/cpu-ops-bench.txt
#   2. k3 bench on the K3-shaped cpu-bench checkpoint (max_position_embeddings raised to 262144, same
#      weights): pp2048 at depth 14336 (random-filled cache), --ubatch 2048, --mla absorbed and auto,
#      each with --profile (the mla_attend share) -> docs/data/cpu-mla-prefill.json
# Usage: bash scripts/measure_mla_prefill.sh [BUILD_DIR=build]   (about 4 minutes on 2 cores)
# Environment: MODEL (default build/cpu-long: generated here with tools/gen/gen_tiny_checkpoint.py
# --preset cpu-bench --max-pos 262144 when absent; needs the tools venv), PYTHON (default build/venv/bin/python).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${1:-build}
k3="$build/bin/k3"
ops="$build/bin/k3_ops_bench"
for b in "$k3" "$ops"; do
  [[ -x $b ]] || { echo "measure_mla_prefill.sh: $b not built (cmake --build $build)" >&2; exit 2; }
done
model=${MODEL:-build/cpu-long}
if [[ ! -f $model/config.json ]]; then
  py=${PYTHON:-build/venv/bin/python}
  [[ -x $py ]] || bash tools/setup_venv.sh
  "$py" tools/gen/gen_tiny_checkpoint.py --preset cpu-bench --seed 1 --out "$model" --no-reference --max-pos 262144
fi
echo "k3_ops_bench (MLA rows) -> docs/data/cpu-ops-bench.txt"
{
  echo "# $ops 0.5   ($(date -u +%F), commit $(git rev-parse --short HEAD), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores)"
  "$ops" 0.5
} > docs/data/cpu-ops-bench.txt
grep -i "mla" docs/data/cpu-ops-bench.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for mla in absorbed auto; do
  echo "k3 bench pp2048 @ d14336, --mla $mla"
  "$k3" bench -m "$model" -p 2048 -n 0 -d 14336 -r 1 --ubatch 2048 --depth-fill random --mla "$mla" \
    --no-progress --profile -o json --json-out "$tmp/$mla.json" > /dev/null
done
python3 - "$tmp" "$(git rev-parse HEAD)" <<'PY'
import json, sys, datetime
tmp, commit = sys.argv[1:]
rows = {}
for mla in ("absorbed", "auto"):
    d = json.load(open(f"{tmp}/{mla}.json"))
    r = d["results"][0]
    ops = {o["op"]: o["ms"] for o in r["profile"]["ops"]}
    rows[mla] = {"pp_ts": r["avg_ts"], "profile_ms_total": sum(ops.values()), "mla_attend_ms": ops.get("mla_attend"),
                 "mla_attend_calls": next(o["calls"] for o in r["profile"]["ops"] if o["op"] == "mla_attend"),
                 "command": d["build"]["command"]}
    build = d["build"]
out = {"what": "pp2048 at depth 14336 (cache filled with seeded random values), --ubatch 2048 (one step), "
               "fast numerics: MLA absorbed vs auto (the tiled expanded form for this piece); the profile run's "
               "mla_attend time (3 MLA layers)",
       "command": "bash scripts/measure_mla_prefill.sh", "results": rows,
       "pp_speedup_auto_vs_absorbed": rows["auto"]["pp_ts"] / rows["absorbed"]["pp_ts"],
       "mla_attend_speedup": rows["absorbed"]["mla_attend_ms"] / rows["auto"]["mla_attend_ms"],
       "machine": {"cpu": build["cpu"], "cores": build["cpu_cores"]}, "commit": commit,
       "date": datetime.date.today().isoformat()}
json.dump(out, open("docs/data/cpu-mla-prefill.json", "w"), indent=1)
print(json.dumps({k: out[k] for k in ("pp_speedup_auto_vs_absorbed", "mla_attend_speedup")}), rows)
print("wrote docs/data/cpu-mla-prefill.json")
PY
