#!/usr/bin/env bash
# Single-thread encode throughput of the k3 tokenizer against tiktoken 0.14.0 (raw, and with the Kimi
# long-input rules the Python tokenizer runs) on the setup corpus (tools/tokenizer/setup_vocab.py),
# in ROUNDS alternating rounds of one run each, so both see the same machine noise. Writes
# docs/data/tokenizer-throughput.json: every run's MB/s, the median and the range (min..max), the
# machine and today's date.
#   bash scripts/measure_tokenizer_throughput.sh [ROUNDS]     (default 5)
# Uses build/tokvenv and build/tokenizer-data as scripts/test.sh makes them, and builds the target
# k3_tok_bench in $K3_BUILD_DIR (default build/).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
rounds=${1:-5}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "measure_tokenizer_throughput.sh: error: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
venv=build/tokvenv
data=build/tokenizer-data
if [[ ! -x $venv/bin/python ]]; then python3 -m venv "$venv"; fi
"$venv/bin/pip" install -q --disable-pip-version-check -r tools/tokenizer/requirements.txt
if [[ ! -f $data/corpus.bin ]]; then "$venv/bin/python" tools/tokenizer/setup_vocab.py --out "$data"; fi
bdir=${K3_BUILD_DIR:-build}
cmake -S . -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_TESTS=ON >/dev/null
cmake --build "$bdir" -j"$(nproc)" --target k3_tok_bench >/dev/null

runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  echo "round $r of $rounds" >&2
  "$bdir/tests/tokenizer/k3_tok_bench" "$data" 1 >>"$runs/k3.jsonl"
  "$venv/bin/python" tools/tokenizer/bench_reference.py "$data" 1 >>"$runs/ref.jsonl"
done

python3 - "$runs" "$rounds" <<'EOF'
import json, os, statistics, subprocess, sys, datetime
runs, rounds = sys.argv[1], int(sys.argv[2])
k3 = [json.loads(l) for l in open(os.path.join(runs, "k3.jsonl"))]
ref = [json.loads(l) for l in open(os.path.join(runs, "ref.jsonl"))]
nbytes = k3[0]["bytes"]
assert all(r["bytes"] == nbytes for r in k3 + ref), "the two benchmarks read different corpora"

def summary(seconds):
    mbps = [round(nbytes / s / 1e6, 2) for s in seconds]
    return {"MBps_median": round(statistics.median(mbps), 2), "MBps_range": [min(mbps), max(mbps)],
            "MBps_runs": mbps, "seconds_runs": [round(s, 4) for s in seconds]}

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
out = {
    "command": f"bash scripts/measure_tokenizer_throughput.sh {rounds}",
    "what": "single-thread encode throughput on the setup corpus (tools/tokenizer/setup_vocab.py, gathered from files "
            f"on the machine that ran it): {nbytes:,} bytes, {k3[0]['tokens']:,} tokens; {rounds} alternating rounds, "
            "one run of each encoder per round; median and range (min, max) over the rounds",
    "machine": f"{cpu}, {os.cpu_count()} cores (shared with other work)",
    "date": datetime.date.today().isoformat(),
    "commit": commit,
    "k3cpp": {"binary": "tests/tokenizer/k3_tok_bench (Release, default flags, no -march=native)",
              **summary([s for r in k3 for s in r["seconds"]]),
              "vocab_load_seconds_median": round(statistics.median(r["load_seconds"] for r in k3), 3)},
    "tiktoken_0.14.0_encode_ordinary": {
        "note": "raw tiktoken on the same text, without the Kimi long-input rules (lower bound for the reference)",
        **summary([s for r in ref for s in r["tiktoken_encode_ordinary_seconds"]])},
    "tiktoken_0.14.0_with_kimi_rules": {
        "note": "tools/tokenizer/kimi_ref.encode_bytes: what the Python tokenizer actually runs",
        **summary([s for r in ref for s in r["tiktoken_plus_kimi_rules_seconds"]])},
    "ids_identical": "checked by test_kimi_vocab (CorpusMatchesReferenceByteExact), not by this script",
}
with open("docs/data/tokenizer-throughput.json", "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print(f"k3 {out['k3cpp']['MBps_median']} MB/s (range {out['k3cpp']['MBps_range']}), tiktoken "
      f"{out['tiktoken_0.14.0_encode_ordinary']['MBps_median']} MB/s, with the Kimi rules "
      f"{out['tiktoken_0.14.0_with_kimi_rules']['MBps_median']} MB/s -> docs/data/tokenizer-throughput.json")
EOF
