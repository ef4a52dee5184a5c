#!/usr/bin/env bash
# Writes docs/data/k3-nano-numerics.json: what each --numerics mode costs in accuracy on the trained
# K3-nano. Perplexity by `k3 eval` in exact / fp32 / fast on the committed validation slice
# (tests/fixtures/k3-nano-slice, ctx 256, stride 256) and, when build/corpus/valid.txt exists
# (models/k3-nano/CORPUS.md), in fp32 / fast on the whole 202,474-token validation split (ctx 512,
# stride 512; exact there is docs/data/k3-nano-eval.json), each beside the PyTorch float64 reference.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build >/dev/null && cmake --build build -j"$(nproc)" --target k3cli >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for n in exact fp32 fast; do
  ./build/bin/k3 eval -m models/k3-nano -f tests/fixtures/k3-nano-slice/slice.txt --ctx 256 --stride 256 \
    --numerics "$n" -q --json "$tmp/slice-$n.json" >/dev/null
done
if [[ -f build/corpus/valid.txt ]]; then
  for n in fp32 fast; do
    ./build/bin/k3 eval -m models/k3-nano -f build/corpus/valid.txt --ctx 512 --stride 512 --numerics "$n" -q \
      --json "$tmp/valid-$n.json" >/dev/null
  done
fi
python3 - "$tmp" <<'PY'
import datetime, json, os, sys
tmp = sys.argv[1]
ref_slice = json.load(open("tests/fixtures/k3-nano-slice/reference.json"))["perplexity"]
ref_valid = json.load(open("docs/data/k3-nano-eval-reference-stride512.json"))["perplexity"]
exact_valid = json.load(open("docs/data/k3-nano-eval.json"))["engine"]["perplexity"]
out = {"command": "bash scripts/measure_numerics.sh", "date": datetime.date.today().isoformat(),
       "slice": {"file": "tests/fixtures/k3-nano-slice/slice.txt", "ctx": 256, "stride": 256,
                 "reference_perplexity": ref_slice, "modes": {}},
       "validation": {"file": "build/corpus/valid.txt", "ctx": 512, "stride": 512,
                      "reference_perplexity": ref_valid,
                      "modes": {"exact": {"perplexity": exact_valid, "relative_to_reference": exact_valid / ref_valid - 1,
                                          "source": "docs/data/k3-nano-eval.json"}}}}
for n in ("exact", "fp32", "fast"):
    e = json.load(open(os.path.join(tmp, f"slice-{n}.json")))
    out["slice"]["modes"][n] = {"perplexity": e["perplexity"], "relative_to_reference": e["perplexity"] / ref_slice - 1,
                                "tokens_per_second": e.get("tokens_per_second")}
for n in ("fp32", "fast"):
    p = os.path.join(tmp, f"valid-{n}.json")
    if os.path.exists(p):
        e = json.load(open(p))
        out["validation"]["modes"][n] = {"perplexity": e["perplexity"], "relative_to_reference": e["perplexity"] / ref_valid - 1,
                                         "tokens_per_second": e.get("tokens_per_second")}
json.dump(out, open("docs/data/k3-nano-numerics.json", "w"), indent=2)
open("docs/data/k3-nano-numerics.json", "a").write("\n")
print(json.dumps(out, indent=2))
PY
