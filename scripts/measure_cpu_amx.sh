#!/usr/bin/env bash
# The amx CPU level (fast-numerics prefill GEMMs on AMX tiles) against avx512 on this CPU:
#   1. bin/k3_gemm_bench at both levels (the prefill GEMMs alone, cpu-bench shapes, against each
#      level's own probed peak) -> docs/data/cpu-gemm-amx.txt
#   2. k3 bench ppN on the K3-shaped cpu-bench checkpoint (fast numerics), --cpu-isa avx512 and amx in
#      alternating rounds (ROUNDS, default 3; the ratio is the median of the per-round ratios), and
#      one --profile run of each (where the prefill time goes) -> docs/data/cpu-amx-prefill.json
# Usage: bash scripts/measure_cpu_amx.sh [BUILD_DIR=build]   (about 5 minutes on 2 cores)
# Environment: MODEL (default build/cpu-bench: generated with tools/gen/gen_tiny_checkpoint.py --preset
# cpu-bench when absent; needs the tools venv), PYTHON (default build/venv/bin/python), PROMPTS (default
# 128,512), ROUNDS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${1:-build}
k3="$build/bin/k3"
gemm="$build/bin/k3_gemm_bench"
for b in "$k3" "$gemm"; do
  [[ -x $b ]] || { echo "measure_cpu_amx.sh: $b not built (cmake --build $build)" >&2; exit 2; }
done
if ! "$k3" info --help >/dev/null 2>&1; then echo "measure_cpu_amx.sh: $k3 does not run" >&2; exit 2; fi
if ! K3_CPU_ISA=amx "$gemm" 0.01 --level amx >/dev/null 2>&1; then
  echo "measure_cpu_amx.sh: this CPU (or its kernel) offers no AMX tiles; nothing to compare" >&2
  exit 2
fi
model=${MODEL:-build/cpu-bench}
if [[ ! -f $model/config.json ]]; then
  py=${PYTHON:-build/venv/bin/python}
  [[ -x $py ]] || bash tools/setup_venv.sh
  "$py" tools/gen/gen_tiny_checkpoint.py --preset cpu-bench --seed 1 --out "$model" --no-reference
fi
prompts=${PROMPTS:-128,512}
rounds=${ROUNDS:-3}
echo "k3_gemm_bench, avx512 then amx -> docs/data/cpu-gemm-amx.txt"
{
  echo "# $gemm 1 --level avx512|amx   ($(date -u +%F), commit $(git rev-parse --short HEAD), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores)"
  for level in avx512 amx; do
    echo "## --level $level"
    "$gemm" 1 --level "$level"
  done
} > docs/data/cpu-gemm-amx.txt
tail -n 16 docs/data/cpu-gemm-amx.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for ((i = 1; i <= rounds; i++)); do
  order="avx512 amx"
  ((i % 2 == 0)) && order="amx avx512"
  for level in $order; do
    echo "round $i: k3 bench -p $prompts --cpu-isa $level"
    "$k3" bench -m "$model" -p "$prompts" -n 0 -r 3 --cpu-isa "$level" --no-progress -o json \
      --json-out "$tmp/$level-$i.json" > /dev/null
  done
done
for level in avx512 amx; do
  "$k3" bench -m "$model" -p 512 -n 0 -r 1 --cpu-isa "$level" --no-progress --no-roofline --profile -o json \
    --json-out "$tmp/$level-profile.json" > /dev/null
done
python3 - "$tmp" "$rounds" "$(git rev-parse HEAD)" "$model" <<'PY'
import json, sys, datetime, statistics
tmp, rounds, commit, model = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = {lv: [json.load(open(f"{tmp}/{lv}-{i}.json")) for i in range(1, rounds + 1)] for lv in ("avx512", "amx")}
tests = [r["test"] for r in runs["avx512"][0]["results"]]
rows = []
for ti, test in enumerate(tests):
    ts = {lv: [d["results"][ti]["avg_ts"] for d in runs[lv]] for lv in runs}
    peak = {lv: [d["results"][ti]["roofline"]["ratio"] for d in runs[lv]] for lv in runs}
    peak_gflops = {lv: [d["results"][ti]["roofline"]["peak_gflops"] for d in runs[lv]] for lv in runs}
    ratios = [b / a for a, b in zip(ts["avx512"], ts["amx"])]
    rows.append({"test": test, "avx512_ts": ts["avx512"], "amx_ts": ts["amx"],
                 "amx_vs_avx512_median": statistics.median(ratios), "amx_vs_avx512_range": [min(ratios), max(ratios)],
                 "ratio_of_own_peak": peak, "own_peak_gflops": peak_gflops})
prof = {}
for lv in ("avx512", "amx"):
    r = json.load(open(f"{tmp}/{lv}-profile.json"))["results"][0]
    total = sum(o["ms"] for o in r["profile"]["ops"])
    prof[lv] = {"pp512_ts": r["avg_ts"], "ops_ms": {o["op"]: round(o["ms"], 2) for o in r["profile"]["ops"]},
                "matmul_share": sum(o["ms"] for o in r["profile"]["ops"] if o["op"].startswith("matmul")) / total,
                "moe_routed_share": sum(o["ms"] for o in r["profile"]["ops"] if o["op"] == "moe_routed") / total}
b = runs["amx"][0]["build"]
out = {"what": "k3 bench ppN on the K3-shaped cpu-bench checkpoint, fast numerics, --cpu-isa avx512 vs amx "
               "(the prefill GEMMs on AMX tiles), alternating rounds of -r 3; ratio = median over rounds of amx/avx512 t/s; "
               "ratio_of_own_peak: each level against its own probed peak (vdpbf16ps / tdpbf16ps)",
       "command": "bash scripts/measure_cpu_amx.sh", "model": model, "rounds": rounds, "results": rows,
       "profile_pp512": prof, "machine": {"cpu": b["cpu"], "cores": b["cpu_cores"]}, "commit": commit,
       "date": datetime.date.today().isoformat()}
json.dump(out, open("docs/data/cpu-amx-prefill.json", "w"), indent=1)
for r in rows:
    print(f'{r["test"]}: avx512 {statistics.median(r["avx512_ts"]):.1f} t/s, amx {statistics.median(r["amx_ts"]):.1f} t/s, '
          f'amx/avx512 {r["amx_vs_avx512_median"]:.2f}x; of own peak: avx512 {statistics.median(r["ratio_of_own_peak"]["avx512"]):.1%}, '
          f'amx {statistics.median(r["ratio_of_own_peak"]["amx"]):.1%}')
for lv, p in prof.items():
    print(lv, "pp512 shares of the profiled step: trunk matmuls", round(p["matmul_share"], 3), "routed experts",
          round(p["moe_routed_share"], 3))
print("wrote docs/data/cpu-amx-prefill.json")
PY
