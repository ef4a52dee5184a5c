#!/usr/bin/env bash
# Threads on a busy machine (issue 17, part 2): k3 bench's default thread count against -t 1, on an
# idle machine and with BUSY competing busy processes (`yes`, one per core by default), for two
# binaries (BASE: a build before the thread pool, e.g. the OpenMP one; NEW: this tree, also with
# K3_ADAPTIVE_THREADS=1), alternating binaries and settings in every round so that all see the same
# machine.
#   bash scripts/measure_busy_threads.sh BASE_K3 NEW_K3 MODEL OUT_JSON [ROUNDS] [BUSY]
# Example (the record docs/data/threads-busy.json; the base is the last commit with OpenMP):
#   git worktree add --detach /tmp/k3-omp 461ee07 && cmake -S /tmp/k3-omp -B /tmp/k3-omp/build \
#     -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=OFF && cmake --build /tmp/k3-omp/build -j2 --target k3cli
#   bash scripts/measure_busy_threads.sh /tmp/k3-omp/build/bin/k3 build/bin/k3 models/k3-nano \
#     docs/data/threads-busy.json
# Each run: `k3 bench -m MODEL $BENCH_ARGS [-t 1]` (default -p 64 -n 32 -r 3: pp64 and tg32, the mean of 3
# repetitions).
set -euo pipefail
[[ $# -ge 4 ]] || { echo "usage: measure_busy_threads.sh BASE_K3 NEW_K3 MODEL OUT_JSON [ROUNDS] [BUSY]" >&2; exit 2; }
base=$1 new=$2 model=$3 out=$4 rounds=${5:-3} busy=${6:-$(nproc)}
for b in "$base" "$new"; do [[ -x $b ]] || { echo "measure_busy_threads.sh: $b is not executable" >&2; exit 2; }; done
[[ -f $model/config.json ]] || { echo "measure_busy_threads.sh: $model has no config.json" >&2; exit 2; }
tmp=$(mktemp -d)
hogs=()
stop_hogs() { for p in "${hogs[@]}"; do kill "$p" 2>/dev/null || true; done; hogs=(); }
trap 'stop_hogs; rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
run() {  # run CONDITION ROUND WHICH THREADS (default | 1 | adaptive: default threads, K3_ADAPTIVE_THREADS=1)
  local bin=$base; [[ $3 == new ]] && bin=$new
  local t=(); [[ $4 == 1 ]] && t=(-t 1)
  local adaptive=0; [[ $4 == adaptive ]] && adaptive=1
  # shellcheck disable=SC2086
  K3_ADAPTIVE_THREADS=$adaptive "$bin" bench -m "$model" $bench_args "${t[@]}" -o json --no-progress >"$tmp/$1-$2-$3-t$4.json" 2>/dev/null
  echo "measure_busy_threads.sh: $1, round $2, $3, threads $4" >&2
}
conditions=${CONDITIONS:-idle busy}
bench_args=${BENCH_ARGS:--p 64 -n 32 -r 3}  # one pp and one tg test  # CONDITIONS=idle: the idle A/B alone (more rounds for a noisy VM)
for cond in $conditions; do
  if [[ $cond == busy ]]; then
    for _ in $(seq 1 "$busy"); do yes >/dev/null & hogs+=($!); done
    sleep 1
  fi
  for r in $(seq 1 "$rounds"); do
    for which in base new; do
      for threads in default 1; do run "$cond" "$r" "$which" "$threads"; done
    done
    run "$cond" "$r" new adaptive
  done
  stop_hogs
done
python3 - "$tmp" "$rounds" "$out" "$base" "$new" "$model" "$load_before" "$busy" "$conditions" "$bench_args" <<'PY'
import datetime, json, subprocess, sys
tmp, rounds, out, base, new, model, load, busy, conds, bench_args = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
conds = conds.split()
def res(cond, r, which, t):
    d = json.load(open(f"{tmp}/{cond}-{r}-{which}-t{t}.json"))
    return {x["test"]: x for x in d["results"]}
doc = {
    "command": ("CONDITIONS=idle " if conds == ["idle"] else "") +
               (f"BENCH_ARGS='{bench_args}' " if bench_args != "-p 64 -n 32 -r 3" else "") +
               f"bash scripts/measure_busy_threads.sh {base} {new} {model} {out} {rounds} {busy}",
    "machine": subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                              text=True).stdout.strip() + f", {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
    "date": datetime.date.today().isoformat(),
    "load_average_before": load,
    "busy": f"{busy} x `yes` (one busy process per core)",
    "test": f"k3 bench {bench_args} (default threads, -t 1, and K3_ADAPTIVE_THREADS=1); t/s is the mean of the repetitions; ratios divide medians over rounds",
    "rounds": rounds,
}
tests = list(res(conds[0], 1, "new", "default").keys())  # the pp and the tg test
summary = {}
for cond in conds:
    for which, t in (("base", "default"), ("base", "1"), ("new", "default"), ("new", "1"), ("new", "adaptive")):
        if True:
            key = f"{cond}_{which}_{'t1' if t == '1' else t}"
            runs = [res(cond, r, which, t) for r in range(1, rounds + 1)]
            entry = {}
            for test in tests:
                ts = [x[test]["avg_ts"] for x in runs]
                entry[test] = {"ts": [round(v, 1) for v in ts], "mean": round(sum(ts) / len(ts), 1),
                               "median": round(sorted(ts)[len(ts) // 2] if len(ts) % 2 else
                                               (sorted(ts)[len(ts) // 2 - 1] + sorted(ts)[len(ts) // 2]) / 2, 1)}
                if "threads_used" in runs[0][test]:
                    entry[test]["threads_used"] = [round(x[test]["threads_used"], 2) for x in runs]
            entry["threads"] = runs[0][tests[0]]["threads"]
            summary[key] = entry
doc["results"] = summary
def ratio(a, b, test):  # of the medians over rounds (a busy VM's runs scatter widely)
    return round(summary[a][test]["median"] / summary[b][test]["median"], 3)
doc["ratios"] = {
    f"{test}_{name}": ratio(a, b, test)
    for test in tests
    for name, a, b in [x for x in (
        ("busy_new_default_vs_new_t1", "busy_new_default", "busy_new_t1"),
        ("busy_new_adaptive_vs_new_t1", "busy_new_adaptive", "busy_new_t1"),
        ("idle_new_adaptive_vs_base_default", "idle_new_adaptive", "idle_base_default"),
        ("busy_base_default_vs_base_t1", "busy_base_default", "busy_base_t1"),
        ("idle_new_default_vs_base_default", "idle_new_default", "idle_base_default"),
        ("idle_new_t1_vs_base_t1", "idle_new_t1", "idle_base_t1"),
    ) if x[1] in summary and x[2] in summary]
}
json.dump(doc, open(out, "w"), indent=2)
for k, v in doc["ratios"].items():
    print(f"{k}: {v}")
print(f"-> {out}")
PY
