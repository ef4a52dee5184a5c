#!/usr/bin/env bash
# Same-machine A/B of single-sequence decode between two k3 binaries (for "no regression" records):
# `k3 bench -p 0 -n 32 -r 3 -t 2 -o json` with each binary, alternating ROUNDS times (a shared VM's
# bandwidth moves between runs), then the mean t/s of each and their ratio.
#   bash scripts/ab_decode.sh BASE_K3 NEW_K3 MODEL OUT_JSON [ROUNDS]
# Example (the record in docs/data/cpu-decode-ab-engine-v2.json: the last commit before Engine v2
# against the current tree, on the cpu-bench checkpoint of scripts/measure_batch.sh):
#   git worktree add --detach /tmp/k3-base 96becf8 && cmake -S /tmp/k3-base -B /tmp/k3-base/build \
#     -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=OFF && cmake --build /tmp/k3-base/build --target k3cli
#   bash scripts/ab_decode.sh /tmp/k3-base/build/bin/k3 build-cpu/bin/k3 build/cpu-bench \
#     docs/data/cpu-decode-ab-engine-v2.json
set -euo pipefail
[[ $# -ge 4 ]] || { echo "usage: ab_decode.sh BASE_K3 NEW_K3 MODEL OUT_JSON [ROUNDS]" >&2; exit 2; }
base=$1 new=$2 model=$3 out=$4 rounds=${5:-3}
for b in "$base" "$new"; do [[ -x $b ]] || { echo "ab_decode.sh: $b is not executable" >&2; exit 2; }; done
[[ -f $model/config.json ]] || { echo "ab_decode.sh: $model has no config.json" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
load=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq 1 "$rounds"); do
  for which in base new; do
    bin=$base; [[ $which == new ]] && bin=$new
    "$bin" bench -m "$model" -p 0 -n 32 -r 3 -t 2 -o json --no-progress >"$tmp/$which-$r.json" 2>/dev/null
  done
done
python3 - "$tmp" "$rounds" "$out" "$base" "$new" "$model" "$load" <<'PY'
import json, sys, platform, subprocess, datetime
tmp, rounds, out, base, new, model, load = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
runs = {w: [json.load(open(f"{tmp}/{w}-{r}.json"))["results"][0] for r in range(1, rounds + 1)] for w in ("base", "new")}
mean = {w: sum(x["avg_ts"] for x in v) / len(v) for w, v in runs.items()}
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
doc = {
    "command": f"bash scripts/ab_decode.sh {base} {new} {model} {out} {rounds}",
    "machine": f"{cpu}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
    "date": datetime.date.today().isoformat(),
    "load_average_before": load,
    "test": "tg32, 1 sequence, 2 threads, -r 3, alternating rounds",
    "base_ts": [round(x["avg_ts"], 2) for x in runs["base"]],
    "new_ts": [round(x["avg_ts"], 2) for x in runs["new"]],
    "base_mean_ts": round(mean["base"], 2),
    "new_mean_ts": round(mean["new"], 2),
    "new_vs_base": round(mean["new"] / mean["base"], 4),
}
json.dump(doc, open(out, "w"), indent=2)
print(f"ab_decode.sh: base {doc['base_mean_ts']} t/s, new {doc['new_mean_ts']} t/s, new/base {doc['new_vs_base']} -> {out}")
PY
