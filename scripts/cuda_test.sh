#!/usr/bin/env bash
# CUDA backend tests in two halves, so a GPU machine only runs what was built here:
#   bash scripts/cuda_test.sh             (here, no GPU needed) builds build-cuda with nvcc and
#                                         stages the k3 binary, the device test binary and the
#                                         third-party fixture into build-cuda-stage/;
#   bash scripts/cuda_test.sh --on-device (on the GPU machine, in a copy of this checkout that
#                                         carries build-cuda-stage/) runs every device test and
#                                         the CLI checks, and prints a pass/fail table.
# With the `device` tool: run(command="bash scripts/cuda_test.sh --on-device",
#                             carry=["build-cuda-stage"]).
# Results: build-cuda-stage/out/ (or $OUT when set): gtest JSON, logs, the table.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
stage=build-cuda-stage

if [[ "${1:-}" != "--on-device" ]]; then
  set -e
  command -v nvcc >/dev/null || { echo "cuda_test.sh: nvcc not found (install the CUDA toolkit)" >&2; exit 2; }
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=ON -DK3_BUILD_TESTS=ON >/dev/null
  cmake --build build-cuda -j"$(nproc)" --target k3cli k3_cuda_tests
  rm -rf "$stage"
  mkdir -p "$stage/shared/fixtures/third-party"
  cp build-cuda/bin/k3 build-cuda/tests/cuda/k3_cuda_tests "$stage/"
  strip "$stage/k3" "$stage/k3_cuda_tests"
  if [[ -d ../shared/fixtures/third-party/kimi-k3-in-c-tiny ]]; then
    cp -r ../shared/fixtures/third-party/kimi-k3-in-c-tiny "$stage/shared/fixtures/third-party/"
  else
    echo "cuda_test.sh: ../shared absent: the third-party tiny gate will skip on the device" >&2
  fi
  du -sh "$stage"
  echo "staged; on the GPU machine: bash scripts/cuda_test.sh --on-device   (carry $stage)"
  exit 0
fi

# ---------------------------------------------------------------- on the GPU machine
out=${OUT:-$stage/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export K3_SOURCE_DIR=$root K3_SHARED_DIR=$root/$stage/shared
k3=$root/$stage/k3
nvidia-smi -L || true
results=()
check() {  # check NAME CMD... : one table row from a command's exit status
  local name=$1
  shift
  if "$@" >>"$out/cli.log" 2>&1; then results+=("PASS|$name"); else results+=("FAIL|$name"); fi
}

"$stage/k3_cuda_tests" --gtest_output=json:"$out/gtest.json" 2>&1 | tee "$out/gtest.log" | grep -E '^\[gate\]|FAILED|Failure' | head -150

# CLI on the GPU against the CPU: same greedy text/ids, logits within the fp32 gate.
nano=models/k3-nano
check "k3 info reports GPU memory" bash -c "$k3 info -m $nano | tee /dev/stderr | grep -q 'GPU memory to run'"
check "run --device cuda (fp32) == CPU exact text" bash -c \
  "diff <($k3 run -q -m $nano --temp 0 -n 40 --numerics fp32 --device cuda 'Once upon a time' 2>/dev/null) \
        <($k3 run -q -m $nano --temp 0 -n 40 --numerics exact 'Once upon a time' 2>/dev/null)"
check "run --device cuda (bf16 default) completes" bash -c \
  "$k3 run -m $nano --temp 0 -n 40 --device cuda 'The little dog' | tee /dev/stderr | grep -q ."
check "generate --device cuda == CPU ids (tiny)" bash -c \
  "diff <($k3 generate -m tests/fixtures/tiny --ids 1,2,3,4,5 -n 24 --print-ids --device cuda) \
        <($k3 generate -m tests/fixtures/tiny --ids 1,2,3,4,5 -n 24 --print-ids)"
check "logits --device cuda within 1e-4 of CPU exact" bash -c \
  "$k3 logits -m tests/fixtures/tiny --ids 3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3 -o $out/gpu.f32 --device cuda && \
   $k3 logits -m tests/fixtures/tiny --ids 3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3 -o $out/cpu.f32 && \
   python3 -c \"import numpy as n,sys;a=n.fromfile('$out/gpu.f32','f4');b=n.fromfile('$out/cpu.f32','f4');e=n.linalg.norm(a-b)/n.linalg.norm(b);print('logits rel-L2',e);sys.exit(e>=1e-4)\""
check "chat --device cuda answers" bash -c \
  "printf 'Hello there\n' | $k3 chat -m $nano --device cuda -n 24 --temp 0 --no-color | grep -q ."
check "bench --device cuda (graphs + no-graphs rows)" bash -c \
  "$k3 bench -m $nano --device cuda -p 64 -n 32 -r 2 --no-progress | tee /dev/stderr | grep -q 'no-graphs'"
check "exact numerics on cuda is a one-line error" bash -c \
  "! $k3 run -m $nano --device cuda --numerics exact -n 2 hi 2>$out/err.txt && test \$(wc -l <$out/err.txt) -eq 1"

python3 - "$out/gtest.json" "${results[@]}" <<'EOF' | tee "$out/table.md"
import json, sys
rows = []
try:
    doc = json.load(open(sys.argv[1]))
    for suite in doc.get("testsuites", []):
        for t in suite.get("testsuite", []):
            name = suite["name"] + "." + t["name"]
            if t.get("failures"):
                status = "FAIL"
            elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                status = "SKIP"
            else:
                status = "PASS"
            rows.append((status, name))
except Exception as e:  # the test binary crashed: no JSON
    rows.append(("FAIL", "k3_cuda_tests (no JSON report: %s)" % e))
for r in sys.argv[2:]:
    s, n = r.split("|", 1)
    rows.append((s, "cli: " + n))
w = max(len(n) for _, n in rows)
print("| %-*s | result |" % (w, "test"))
print("|%s|--------|" % ("-" * (w + 2)))
for s, n in rows:
    print("| %-*s | %-6s |" % (w, n, s))
p = sum(s == "PASS" for s, _ in rows); f = sum(s == "FAIL" for s, _ in rows); k = sum(s == "SKIP" for s, _ in rows)
print("\n%d passed, %d failed, %d skipped" % (p, f, k))
sys.exit(1 if f else 0)
EOF
