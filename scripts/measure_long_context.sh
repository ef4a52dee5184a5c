#!/usr/bin/env bash
# Long-context correctness at N tokens (issue 22): chunked prefill vs token by token, fp32, on the
# tiny K3 and Kimi Linear fixtures (tests/model/test_long_context.cpp with K3_LONG_CONTEXT=N), and
# writes docs/data/long-context-<N>.json (rel-L2 of the last 16 positions' logits, wall times,
# machine, commit). Usage: bash scripts/measure_long_context.sh [N=65536] [BUILD_DIR=build-cpu]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
n=${1:-65536}
build=${2:-build-cpu}
bin="$build/tests/model/test_long_context"
[[ -x $bin ]] || { echo "measure_long_context.sh: $bin not built (cmake --build $build --target test_long_context)" >&2; exit 2; }
out=docs/data/long-context-$n.json
log=$(mktemp)
echo "running $bin at $n tokens (minutes: the token-by-token pass attends over the whole cache at every step)"
K3_LONG_CONTEXT=$n "$bin" 2>&1 | tee "$log"
python3 - "$log" "$out" "$n" "$(git rev-parse HEAD)" "$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')" "$(nproc)" <<'PY'
import json, re, sys, datetime
log, out, n, commit, cpu, cores = sys.argv[1:]
rows = []
for line in open(log):
    m = re.match(r"long context (\S+): T=(\d+), last (\d+) positions fp32 chunked prefill vs token by token rel-L2 (\S+) "
                 r"\(chunked ([\d.]+) s, token by token ([\d.]+) s\)", line)
    if m:
        rows.append(dict(fixture=m[1], tokens=int(m[2]), positions_compared=int(m[3]), rel_l2=float(m[4]),
                         chunked_prefill_s=float(m[5]), token_by_token_s=float(m[6])))
passed = "FAILED" not in open(log).read()
if not rows:
    sys.exit("no result lines in the test output")
json.dump(dict(what="chunked prefill (chunked KDA, state carried across 512-row pieces; MLA over the paged "
                    "latent cache) vs the same ids fed one token at a time (recurrent KDA), fp32 numerics, "
                    "logits of the last positions compared by rel-L2; gate 1e-4 (issue 22)",
               command=f"bash scripts/measure_long_context.sh {n}", gate=1e-4, passed=passed, results=rows,
               machine=dict(cpu=cpu, cores=int(cores)), commit=commit,
               date=datetime.date.today().isoformat()), open(out, "w"), indent=1)
print("wrote", out)
PY
rm -f "$log"
