#!/usr/bin/env bash
# On a machine with 2 or more GPUs (the device tool's nvidia-h200-x2/-x4/-x8): a model split over GPU
# processes, one per GPU, started by hand (--rank/--world/--master on 127.0.0.1; MPI not needed),
# tensor parallel over NCCL (issue 23). Uses the k3 packed by `bash scripts/cuda_test.sh` here
# (build-cuda-stage/cli.tar.xz). Checks, then measures:
#   1. K3-nano and tiny, fp32: `k3 logits` of TP2 vs one GPU (rel-L2, gate 1e-5) and `k3 generate`
#      greedy ids equal; then TP4/TP8 when the GPUs are there and the heads divide;
#   2. k3 bench on gpu-bench (generated here if absent): pp512 / tg128 on 1 GPU and TP2 (and TP4, TP8).
# Writes $OUT/multi-gpu-check.json (and the logs). NCCL_NVLS_ENABLE=0 stays set (the device rules).
#   run(kind="nvidia-h200-x2", command="bash scripts/multi_gpu_check.sh", carry=["build-cuda-stage/cli.tar.xz"])
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "multi_gpu_check: $gpus GPU(s)"
((gpus >= 2)) || { echo "multi_gpu_check: needs 2 or more GPUs"; exit 2; }
port=29517
# N processes of `k3 ARGS --tp N`, rank 0's stdout to $2, every rank's stderr to $2.rankR.err.
launch() {
  local n=$1 stdout=$2
  shift 2
  local pids=() r rc=0
  for ((r = n - 1; r >= 1; --r)); do
    LOCAL_RANK=$r "$k3" "$@" --tp "$n" --rank "$r" --world "$n" --master "127.0.0.1:$port" \
      >/dev/null 2>"$stdout.rank$r.err" &
    pids+=($!)
  done
  LOCAL_RANK=0 "$k3" "$@" --tp "$n" --rank 0 --world "$n" --master "127.0.0.1:$port" >"$stdout" 2>"$stdout.rank0.err" || rc=$?
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  port=$((port + 1))
  return $rc
}
relerr() {
  python3 -c "import numpy as n,sys;a=n.fromfile(sys.argv[1],n.float32);b=n.fromfile(sys.argv[2],n.float32);print(float(n.linalg.norm(a-b)/n.linalg.norm(b)) if a.size==b.size else 'size')" "$1" "$2"
}
json="$out/multi-gpu-check.json"
echo "{" >"$json"
ids=3,141,59,26,5,35,89,79,32,38,46,26,43
for m in models/k3-nano tests/fixtures/tiny; do
  name=$(basename $m)
  CUDA_VISIBLE_DEVICES=0 "$k3" logits -m "$m" --ids "$ids" -o "$out/$name.one.f32" --device cuda --numerics fp32 2>"$out/$name.one.err"
  CUDA_VISIBLE_DEVICES=0 "$k3" generate -m "$m" --ids "$ids" -n 16 --print-ids --device cuda --numerics fp32 >"$out/$name.one.ids" 2>>"$out/$name.one.err"
  for n in 2 4 8; do
    ((n <= gpus)) || continue
    if launch "$n" "$out/$name.tp$n.log" logits -m "$m" --ids "$ids" -o "$out/$name.tp$n.f32" --device cuda --numerics fp32 &&
       launch "$n" "$out/$name.tp$n.ids" generate -m "$m" --ids "$ids" -n 16 --print-ids --device cuda --numerics fp32; then
      e=$(relerr "$out/$name.tp$n.f32" "$out/$name.one.f32")
      same=$(cmp -s "$out/$name.tp$n.ids" "$out/$name.one.ids" && echo true || echo false)
      echo "multi_gpu_check: $name TP$n fp32 logits rel-L2 $e (gate 1e-5), greedy ids equal: $same"
      echo "  \"$name TP$n\": {\"rel_l2\": \"$e\", \"greedy_equal\": $same}," >>"$json"
    else
      echo "multi_gpu_check: $name TP$n FAILED: $(cat "$out/$name.tp$n"*.err | grep -m3 error)"
      echo "  \"$name TP$n\": \"failed\"," >>"$json"
    fi
  done
done
ckpt=${K3_GPU_BENCH_DIR:-/tmp/gpu-bench}
if ensure_gpu_bench "$ckpt"; then
  bench=(bench -m "$ckpt" -p 512 -n 128 -r 3 -o json --no-progress --device cuda)
  CUDA_VISIBLE_DEVICES=0 "$k3" "${bench[@]}" >"$out/bench.one.json" 2>"$out/bench.one.err"
  for n in 2 4 8; do
    ((n <= gpus)) || continue
    launch "$n" "$out/bench.tp$n.json" "${bench[@]}" || echo "multi_gpu_check: bench TP$n failed"
  done
  python3 - "$out" >>"$json" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = {}
for f in sorted(os.listdir(out)):
    if f.startswith("bench.") and f.endswith(".json"):
        try:
            d = json.load(open(os.path.join(out, f)))
            rows[f[6:-5]] = {r["test"]: r["avg_ts"] for r in d["results"]}
        except Exception as e:
            rows[f[6:-5]] = str(e)
print('  "gpu-bench t/s": ' + json.dumps(rows) + ",")
PY
fi
echo "  \"gpus\": $gpus" >>"$json"
echo "}" >>"$json"
cat "$json"
