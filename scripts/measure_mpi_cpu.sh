#!/usr/bin/env bash
# Ranks as processes on this machine's CPU (issue 23): k3 bench on K3-nano as one process (1 and 2
# threads) and as two MPI processes of one thread each (TP2, EP2, TP2 x EP2), ROUNDS alternating
# rounds, medians; writes docs/data/mpi-cpu-bench.json. On one machine the processes share its
# cores and memory: this shows what the split costs or gains against threads, not a second machine.
#   bash scripts/measure_mpi_cpu.sh [BUILD_DIR]     (ROUNDS=3, OUT=docs/data/mpi-cpu-bench.json)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build}
k3="$(cd "$build" && pwd)/bin/k3"
rounds=${ROUNDS:-3}
out=${OUT:-$root/docs/data/mpi-cpu-bench.json}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_MCA_rtc='^hwloc' OMPI_MCA_btl_vader_single_copy_mechanism=none PMIX_MCA_gds=hash
bench=(bench -m "$root/models/k3-nano" -p 128 -n 32 -r 5 -o json --no-roofline --no-progress)
mpi=(mpirun --allow-run-as-root -np 2)
configs=("1proc_t1" "1proc_t2" "2proc_tp2" "2proc_ep2" "2proc_tp2ep2")
for ((i = 1; i <= rounds; ++i)); do
  for c in "${configs[@]}"; do
    case "$c" in
      1proc_t1) "$k3" "${bench[@]}" -t 1 ;;
      1proc_t2) "$k3" "${bench[@]}" -t 2 ;;
      2proc_tp2) "${mpi[@]}" "$k3" "${bench[@]}" -t 1 --tp 2 ;;
      2proc_ep2) "${mpi[@]}" "$k3" "${bench[@]}" -t 1 --ep 2 ;;
      2proc_tp2ep2) "${mpi[@]}" "$k3" "${bench[@]}" -t 1 --tp 2 --ep 2 ;;
    esac >"$work/$c.$i.json"
    echo "measure_mpi_cpu: round $i $c done" >&2
  done
done
python3 - "$work" "$out" "$rounds" "$(git -C "$root" rev-parse --short HEAD)" "${configs[@]}" <<'PY'
import json, statistics, sys, platform, datetime
work, out, rounds, commit, *configs = sys.argv[1:]
rounds = int(rounds)
res, cpu = {}, None
for c in configs:
    runs = [json.load(open(f"{work}/{c}.{i}.json")) for i in range(1, rounds + 1)]
    cpu = runs[0]["build"]["cpu"]
    tests = {}
    for r in runs:
        for t in r["results"]:
            tests.setdefault(t["test"], []).append(t["avg_ts"])
    res[c] = {k: {"median_ts": round(statistics.median(v), 2), "rounds_ts": [round(x, 2) for x in v]} for k, v in tests.items()}
base = res["1proc_t1"]
for c in configs:
    for k, v in res[c].items():
        v["vs_1proc_t1"] = round(v["median_ts"] / base[k]["median_ts"], 3)
        v["vs_1proc_t2"] = round(v["median_ts"] / res["1proc_t2"][k]["median_ts"], 3)
json.dump({
    "command": "bash scripts/measure_mpi_cpu.sh",
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "commit": commit, "cpu": cpu, "machine": platform.node(),
    "model": "models/k3-nano (43 MiB: cache-resident, so compute-bound; not a memory-bound large model)",
    "bench": "k3 bench -p 128 -n 32 -r 5, medians of %d alternating rounds" % rounds,
    "configs": {"1proc_t1": "one process, 1 thread", "1proc_t2": "one process, 2 threads",
                "2proc_tp2": "mpirun -np 2, 1 thread each, --tp 2", "2proc_ep2": "mpirun -np 2, 1 thread each, --ep 2",
                "2proc_tp2ep2": "mpirun -np 2, 1 thread each, --tp 2 --ep 2"},
    "results": res,
}, open(out, "w"), indent=2)
print(json.dumps({c: {k: (v["median_ts"], v["vs_1proc_t1"]) for k, v in r.items()} for c, r in res.items()}))
PY
