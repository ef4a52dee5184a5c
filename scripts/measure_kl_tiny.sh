#!/usr/bin/env bash
# Kimi Linear on its tiny fixture: k3's logits in every CPU numerics (exact, fp32, fast) against the
# fixture's transformers fp32 logits (tests/fixtures/kl-tiny/logits.f32), rel-L2 and argmax agreement,
# and greedy ids against the fixture's; writes docs/data/kimi-linear-tiny.json.
# Usage: bash scripts/measure_kl_tiny.sh [K3=build-cpu/bin/k3]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
k3=${1:-build-cpu/bin/k3}
fx=tests/fixtures/kl-tiny
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ids=$(python3 -c "import json;print(','.join(map(str,json.load(open('$fx/reference.json'))['ids'])))")
prompt=$(python3 -c "import json;print(','.join(map(str,json.load(open('$fx/reference.json'))['greedy']['prompt'])))")
n=$(python3 -c "import json;print(json.load(open('$fx/reference.json'))['greedy']['n'])")
for num in exact fp32 fast; do
  "$k3" logits -m "$fx" --ids "$ids" -o "$tmp/$num.f32" --numerics "$num" >/dev/null
  "$k3" generate -m "$fx" --ids "$prompt" -n "$n" --numerics "$num" --print-ids >"$tmp/$num.greedy"
done
python3 - "$fx" "$tmp" "$k3" "$(git rev-parse HEAD)" "$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')" <<'PY'
import array, datetime, json, math, sys
fx, tmp, k3, commit, cpu = sys.argv[1:]
ref = json.load(open(f"{fx}/reference.json"))
V = ref["vocab_size"]
def load(p):
    a = array.array("f"); a.frombytes(open(p, "rb").read()); return a
want = load(f"{fx}/logits.f32")
rows = {}
for num in ("exact", "fp32", "fast"):
    got = load(f"{tmp}/{num}.f32")
    d = math.sqrt(sum((x - y) ** 2 for x, y in zip(got, want))) / math.sqrt(sum(y * y for y in want))
    am = [max(range(V), key=lambda j, t=t: got[t * V + j]) for t in range(len(got) // V)]
    greedy = [int(x) for x in open(f"{tmp}/{num}.greedy").read().split()]
    rows[num] = dict(rel_l2_vs_transformers=d, argmax_equal=am == ref["tf_argmax"],
                     greedy_equal=greedy == ref["greedy"]["ids"])
json.dump(dict(what="k3 logits/generate on tests/fixtures/kl-tiny (Kimi Linear, released layout) vs the fixture's "
                    "transformers 5.25.0 KimiLinearForCausalLM fp32 logits (teacher-forced, 24 ids) and greedy ids",
               command="bash scripts/measure_kl_tiny.sh", results=rows,
               fixture_own_float64_vs_transformers=ref["agreement"]["own_float64_vs_transformers_fp32_rel_l2"],
               machine=dict(cpu=cpu), commit=commit, date=datetime.date.today().isoformat()),
          open("docs/data/kimi-linear-tiny.json", "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
