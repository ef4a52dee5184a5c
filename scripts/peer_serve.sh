#!/usr/bin/env bash
# Server against server on the same machine, model and load (issue 18): `k3 serve` and llama.cpp's
# OpenAI server (llama-cpp-python[server] 0.3.36, on the K3-nano GGUF from tools/peer/k3_to_gguf.py),
# each loaded by tools/peer/serve_bench.py with 1, 4 and 16 concurrent streaming /v1/completions
# streams (greedy, the same prompts, ROUNDS alternating rounds), then docs/data/peer-serve.json.
#   bash scripts/peer_serve.sh [MODEL_DIR] [OUT_JSON]     (defaults models/k3-nano, docs/data/peer-serve.json)
# Environment: K3 (default build/bin/k3), THREADS (default: nproc), ROUNDS (default 2), REQUESTS
# (requests per stream, default 4), MAX_TOKENS (default 64), STREAMS (default 1,4,16).
# llama-cpp-python's server runs one request at a time (no continuous batching; --interrupt_requests
# False so a new request waits instead of cutting the running one); k3 serve runs --parallel 16.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
model=${1:-models/k3-nano} out=${2:-docs/data/peer-serve.json}
k3=${K3:-build/bin/k3} threads=${THREADS:-$(nproc)} rounds=${ROUNDS:-2} requests=${REQUESTS:-4}
max_tokens=${MAX_TOKENS:-64} streams=${STREAMS:-1,4,16}
venv=build/peer-venv py=build/peer-venv/bin/python
[[ -x $k3 ]] || { echo "peer_serve.sh: $k3 is not built" >&2; exit 2; }
bash scripts/peer_llamacpp.sh --setup-only
"$venv/bin/pip" install -q --disable-pip-version-check -r tools/peer/requirements-server.txt
llama_src=$(ls -d build/peer-src/llama_cpp_python-*/vendor/llama.cpp | head -1)
gguf=$("$py" - "$model" "$llama_src" <<'PY'
import sys, types
sys.path.insert(0, "tools/peer")
import llamacpp_bench as b
a = types.SimpleNamespace(gguf=None, ckpt=sys.argv[1], llama_src=sys.argv[2], outtype="bf16",
                          cache_dir=str(b.DEFAULT_CACHE), reconvert=False)
print(b.ensure_gguf(a)[0])
PY
)
echo "peer_serve.sh: GGUF $gguf" >&2
tmp=$(mktemp -d)
pid=""
cleanup() { [[ -n $pid ]] && kill "$pid" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
# 64 prompts, different for every request (no prefix shared beyond a few words).
"$py" - >"$tmp/prompts.txt" <<'PY'
subjects = ["The function", "A database index", "The compiler", "This module", "The server", "A transaction",
            "The parser", "The scheduler"]
verbs = ["returns", "stores", "checks", "creates", "reads", "writes", "updates", "removes"]
for s in subjects:
    for v in verbs:
        print(f"{s} {v}")
PY
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_ready() {  # URL
  for _ in $(seq 1 600); do
    if curl -sf "$1/v1/models" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "peer_serve.sh: $1 did not come up" >&2; return 1
}
bench() {  # NAME URL MODEL EXTRA_JSON ROUND
  "$py" tools/peer/serve_bench.py --url "$2" --model "$3" --streams "$streams" --requests "$requests" \
    --max-tokens "$max_tokens" --prompts "$tmp/prompts.txt" --extra "$4" --out "$tmp/$1-$5.json" |
    sed "s/^/$1 round $5: /"
}
for r in $(seq 1 "$rounds"); do
  port=$(free_port)
  "$k3" serve -m "$model" --port "$port" -t "$threads" --parallel 16 -q >"$tmp/k3.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port"
  bench k3 "http://127.0.0.1:$port" k3-nano '{"ignore_eos": true}' "$r"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  port=$(free_port)
  "$py" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 --port "$port" --n_threads "$threads" \
    --n_threads_batch "$threads" --n_ctx 4096 --interrupt_requests False --model_alias k3-nano >"$tmp/llama.log" 2>&1 &
  pid=$!
  wait_ready "http://127.0.0.1:$port"
  bench llamacpp "http://127.0.0.1:$port" k3-nano '{}' "$r"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
done
"$py" - "$tmp" "$rounds" "$out" "$model" "$threads" "$requests" "$max_tokens" "$streams" "$gguf" <<'PY'
import datetime, json, statistics, subprocess, sys
tmp, rounds, out, model, threads, requests, max_tokens, streams, gguf = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
runs = {e: [json.load(open(f"{tmp}/{e}-{r}.json")) for r in range(1, rounds + 1)] for e in ("k3", "llamacpp")}
def med(e, s, key):
    vals = [lv[key] for run in runs[e] for lv in run["levels"] if lv["streams"] == s and lv[key] is not None]
    return round(statistics.median(vals), 3) if vals else None
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
summary = []
for s in [int(x) for x in streams.split(",")]:
    row = {"streams": s}
    for e in ("k3", "llamacpp"):
        for key in ("aggregate_tps", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            row[f"{e}_{key}"] = med(e, s, key)
    row["k3_vs_llamacpp_tps"] = round(row["k3_aggregate_tps"] / row["llamacpp_aggregate_tps"], 2)
    summary.append(row)
doc = {
    "command": f"bash scripts/peer_serve.sh {model} {out}",
    "machine": f"{cpu}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
    "date": datetime.date.today().isoformat(),
    "setup": {"threads": int(threads), "requests_per_stream": int(requests), "max_tokens": int(max_tokens),
              "rounds": rounds, "k3": "k3 serve --parallel 16 (ignore_eos)",
              "llamacpp": "llama-cpp-python[server] 0.3.36, --interrupt_requests False (one request at a time)",
              "gguf": gguf.split("/")[-1], "stat": "median over rounds"},
    "summary": summary,
    "runs": runs,
}
json.dump(doc, open(out, "w"), indent=2)
for row in summary:
    print(json.dumps(row))
print("->", out)
PY
