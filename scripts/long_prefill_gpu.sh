#!/usr/bin/env bash
# Issue 22 on the GPU machine: a million-token prefill, then 64 greedy decode steps from it, on one
# GPU, with the wall time, prefill t/s, decode t/s and the device memory (nvidia-smi's peak and
# cudaMemGetInfo at the end) against what `k3 info --ctx` plans (tools/long_prefill.py).
# Run on the GPU machine after `bash scripts/cuda_test.sh` packed build-cuda-stage/cli.tar.xz here:
#   run(command="bash scripts/long_prefill_gpu.sh", carry=["build-cuda-stage/cli.tar.xz"])
# The model: the long-1m preset of tools/gen/gen_tiny_checkpoint.py (K3's attention widths: 96 KDA
# heads, 96 MLA heads with the 512 + 64 latent; hidden 7168; 4 layers, 3 KDA + 1 MLA), generated
# there into /tmp/long-1m (~4.5 GB, about a minute). Environment:
#   LONG_TOKENS (default 1048512: with the 64 decoded tokens the whole 1,048,576-position window),
#   LONG_UBATCH (prefill tokens per step, default 4096), LONG_JSON (default long-prefill-cuda-<tokens>.json).
# Writes $OUT (or build-cuda-stage/out): the JSON record, the bench's log, k3 info's plan.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
tokens=${LONG_TOKENS:-1048512}
ubatch=${LONG_UBATCH:-4096}
json=${LONG_JSON:-long-prefill-cuda-$tokens.json}
ckpt=/tmp/long-1m
nvidia-smi -L || true
if [[ ! -f $ckpt/config.json ]]; then
  t0=$(date +%s)
  python3 tools/gen/gen_tiny_checkpoint.py --preset long-1m --seed 1 --out "$ckpt" --no-reference >/tmp/gen.log 2>&1 ||
    { tail -5 /tmp/gen.log; exit 1; }
  echo "generated long-1m in $(($(date +%s) - t0)) s: $(du -sh "$ckpt" | cut -f1)"
fi
"$k3" info -m "$ckpt" --ctx $((tokens + 64)) --ubatch "$ubatch" | tee "$out/long-prefill-info.txt"
PYTHONUNBUFFERED=1 python3 tools/long_prefill.py --k3 "$k3" --model "$ckpt" --tokens "$tokens" --decode 64 \
  --ubatch "$ubatch" --device cuda --json "$out/$json" --log "$out/long-prefill-bench.log"
rc=$?
tail -c 3000 "$out/long-prefill-bench.log"
exit $rc
