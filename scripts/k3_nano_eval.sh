#!/usr/bin/env bash
# Writes docs/data/k3-nano-eval.json: K3-nano's perplexity on its validation split by the engine
# (`k3 eval --ctx 512 --stride 512`) beside the PyTorch float64 reference's
# (docs/data/k3-nano-eval-reference-stride512.json, from tools/train/eval_reference.py, same
# protocol), their relative difference, and the unigram baseline. Needs build/corpus/valid.txt
# (models/k3-nano/CORPUS.md, steps 1-3). ENGINE_JSON=FILE reuses an engine result already made.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=docs/data/k3-nano-eval-reference-stride512.json
engine=${ENGINE_JSON:-build/k3-nano-eval-engine.json}
if [[ -z ${ENGINE_JSON:-} ]]; then
  cmake -S . -B build >/dev/null && cmake --build build -j"$(nproc)" --target k3cli >/dev/null
  # Exact numerics: this is the comparison with the float64 reference (docs/performance.md).
  ./build/bin/k3 eval -m models/k3-nano -f build/corpus/valid.txt --ctx 512 --stride 512 --numerics exact --json "$engine"
fi
python3 - "$engine" "$ref" <<'PY'
import json, sys, subprocess, datetime
e, r = (json.load(open(p)) for p in sys.argv[1:3])
u = json.load(open("docs/data/k3-nano-unigram.json"))
cpu = subprocess.run("lscpu | sed -n 's/^Model name: *//p' | head -1", shell=True, capture_output=True, text=True).stdout.strip()
for k in ("tokens", "tokens_scored", "ctx", "stride", "windows"):
    assert e[k] == r[k], f"{k}: engine {e[k]} vs reference {r[k]}"
out = {
    "command": "bash scripts/k3_nano_eval.sh",
    "date": datetime.date.today().isoformat(),
    "split": "build/corpus/valid.txt (202,474-token validation split, models/k3-nano/CORPUS.md)",
    "protocol": f"k3 eval windows: ctx {e['ctx']}, stride {e['stride']}, fresh session per window (docs/eval.md)",
    "engine": {"perplexity": e["perplexity"], "nll_sum": e["nll_sum"], "tokens_scored": e["tokens_scored"],
               "bits_per_byte": e.get("bits_per_byte"), "tokens_per_second": e.get("tokens_per_second"),
               "machine": f"{cpu}, 2 cores (dev machine)"},
    "reference": {"perplexity": r["perplexity"], "nll_sum": r["nll_sum"], "implementation": r["implementation"],
                  "file": "docs/data/k3-nano-eval-reference-stride512.json"},
    "relative_difference": abs(e["perplexity"] / r["perplexity"] - 1),
    "unigram_baseline_perplexity": u["perplexity"],
}
json.dump(out, open("docs/data/k3-nano-eval.json", "w"), indent=2)
open("docs/data/k3-nano-eval.json", "a").write("\n")
print(json.dumps(out, indent=2))
PY
