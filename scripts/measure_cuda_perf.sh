#!/usr/bin/env bash
# The `k3` command on the GPU, and the GPU numbers for docs/data. Run on the GPU machine after
# `bash scripts/cuda_test.sh` packed build-cuda-stage/cli.tar.xz here:
#   run(command="bash scripts/measure_cuda_perf.sh", carry=["build-cuda-stage/cli.tar.xz"])
# 1. CLI checks with --device cuda against the CPU in the same binary (run/generate/logits/chat/
#    info/bench, and the one-line refusals), as a pass/fail table (cli-table.md).
# 2. Generates the K3-shaped gpu-bench checkpoint (~5 GB, tools/gen preset) on that machine and
#    runs `k3 bench --device cuda` in both numerics, tgN with and without CUDA graphs, at depth 0
#    and 3072; then the bundled K3-nano. Roofline column: tg t/s x bytes one decode step reads
#    (weights touched + KDA state + MLA cache) / the device-copy bandwidth measured in the run.
# Writes $OUT (or build-cuda-stage/out): cli-table.md, cli.log, cuda-bench-*.json/.md (8 files).
# Set K3_SKIP_BENCH=1 for the CLI checks alone.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
nano=models/k3-nano
results=()
check() {  # check NAME CMD... : one table row from the exit status of CMD
  local name=$1
  shift
  echo "== $name" >>"$out/cli.log"
  if "$@" >>"$out/cli.log" 2>&1; then results+=("PASS|cli: $name"); else results+=("FAIL|cli: $name"); fi
}
same_nonempty() {  # both commands succeed, print something, and print the same
  local a b
  a=$(bash -c "$1") || return 1
  b=$(bash -c "$2") || return 1
  [[ -n $a && $a == "$b" ]] || { echo "differ: [$a] vs [$b]"; return 1; }
  echo "$a"
}
check "info reports the GPU memory needed and that it fits" bash -c "$k3 info -m $nano | tee -a /dev/stderr | grep -q 'H200.*(fits)'"
check "cuBLAS is loaded for --device cuda only (LD_DEBUG=libs: not by info, tokenize or a CPU run)" bash -c \
  "! (LD_DEBUG=libs $k3 info -m $nano 2>&1 >/dev/null | grep libcublas) && \
   ! (LD_DEBUG=libs $k3 tokenize -m $nano --text hi 2>&1 >/dev/null | grep libcublas) && \
   ! (LD_DEBUG=libs $k3 run -q -m $nano -n 2 hi 2>&1 >/dev/null | grep libcublas) && \
   LD_DEBUG=libs $k3 run -q -m $nano -n 2 --device cuda hi 2>&1 >/dev/null | grep -m1 'calling init:.*libcublas.so'"
check "run --device cuda --numerics fp32 == CPU exact (greedy text)" same_nonempty \
  "$k3 run -q -m $nano --temp 0 -n 40 --numerics fp32 --device cuda 'Once upon a time' 2>/dev/null" \
  "$k3 run -q -m $nano --temp 0 -n 40 --numerics exact 'Once upon a time' 2>/dev/null"
check "run --device cuda (default bf16) streams text + summary" bash -c \
  "$k3 run -m $nano --temp 0 -n 40 --device cuda 'The little dog' 2>&1 | tee -a /dev/stderr | grep -q 'decode'"
# The fixture's own greedy prompt (chosen by its generator to have no near-tied logits).
read -r gen_ids gen_n < <(python3 -c "import json;g=json.load(open('tests/fixtures/tiny/reference.json'))['greedy'];print(','.join(map(str,g['prompt'])),g['n'])")
check "generate --device cuda == CPU exact == reference (ids, tiny)" bash -c \
  "a=\$($k3 generate -m tests/fixtures/tiny --ids $gen_ids -n $gen_n --greedy --print-ids --device cuda) && \
   b=\$($k3 generate -m tests/fixtures/tiny --ids $gen_ids -n $gen_n --greedy --print-ids) && echo \"gpu [\$a] cpu [\$b]\" && \
   test -n \"\$a\" && test \"\$a\" = \"\$b\" && python3 -c \"import json,sys;g=json.load(open('tests/fixtures/tiny/reference.json'))['greedy'];sys.exit(' '.join(map(str,g['ids']))!='\$a')\""
check "logits --device cuda within 1e-4 rel-L2 of CPU exact" bash -c \
  "$k3 logits -m tests/fixtures/tiny --ids 3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3 -o /tmp/gpu.f32 --device cuda && \
   $k3 logits -m tests/fixtures/tiny --ids 3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3 -o /tmp/cpu.f32 && \
   python3 -c \"import numpy as n,sys;a=n.fromfile('/tmp/gpu.f32','f4');b=n.fromfile('/tmp/cpu.f32','f4');e=n.linalg.norm(a-b)/n.linalg.norm(b);print('logits rel-L2',e);sys.exit(not(a.size==b.size>0 and e<1e-4))\""
check "chat --device cuda answers a piped message" bash -c \
  "printf 'Hello there\n' | $k3 chat -m $nano --device cuda -n 24 --temp 0 --no-color 2>&1 | tee -a /dev/stderr | grep -q ."
check "bench --device cuda prints graphs and no-graphs rows" bash -c \
  "$k3 bench -m $nano --device cuda -p 64 -n 32 -r 2 --no-progress | tee -a /dev/stderr | grep -q 'no-graphs'"
check "--numerics exact on cuda: one-line error, exit 2" bash -c \
  "$k3 run -m $nano --device cuda --numerics exact -n 2 hi 2>/tmp/err.txt; rc=\$?; cat /tmp/err.txt; test \$rc -eq 2 && test \$(wc -l </tmp/err.txt) -eq 1"
check "run --device cuda --ram-budget (experts streamed) == all resident (greedy text)" same_nonempty \
  "$k3 run -q -m $nano --temp 0 -n 40 --device cuda --ram-budget 27M 'Once upon a time' 2>/dev/null" \
  "$k3 run -q -m $nano --temp 0 -n 40 --device cuda 'Once upon a time' 2>/dev/null"
check "generate --ids-file --device cuda: each line == that prompt alone" bash -c \
  "printf '11,220,3300,4,57\\n900\\n1,2,3,4,5,6,7,8,9,10,11,12\\n' >/tmp/ids.txt && \
   a=\$($k3 generate -m $nano --ids-file /tmp/ids.txt -n 8 --greedy --print-ids --device cuda) && \
   b=\$(for p in 11,220,3300,4,57 900 1,2,3,4,5,6,7,8,9,10,11,12; do $k3 generate -m $nano --ids \$p -n 8 --greedy --print-ids --device cuda; done) && \
   echo \"[\$a] [\$b]\" && test -n \"\$a\" && test \"\$a\" = \"\$b\""
python3 tools/gtest_table.py - "${results[@]}" | tee "$out/cli-table.md"

[[ "${K3_SKIP_BENCH:-0}" == 1 ]] && exit 0
ckpt=${K3_GPU_BENCH_DIR:-/tmp/gpu-bench}
ensure_gpu_bench "$ckpt" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
for num in fast fp32; do
  "$k3" bench -m "$ckpt" --device cuda --numerics "$num" -p 512 -n 128 -d 0,3072 -r 5 --no-progress \
    --json-out "$out/cuda-bench-gpu-bench-$num.json" | tee "$out/cuda-bench-gpu-bench-$num.md"
done
"$k3" bench -m "$nano" --device cuda -p 512 -n 128 -r 5 --no-progress \
  --json-out "$out/cuda-bench-k3-nano-fast.json"
