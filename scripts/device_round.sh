#!/usr/bin/env bash
# The GPU measurements the issues wait for, as named steps of one device call, so a short lease
# runs as many as fit: each step under its own time limit, its files tarred into $OUT/STEP.tar (the
# device tool brings back at most 8 files), its tail printed. Build and pack here first:
#   bash scripts/cuda_test.sh                 (build-cuda-stage/gates.tar.xz, cli.tar.xz)
#   bash scripts/measure_kda_peers.sh --pack  (build-kdabench-stage/kda-bench.tar.xz, kda-wheels.tar.xz)
# then, for example:
#   run(command="bash scripts/device_round.sh gates profile",
#       carry=["build-cuda-stage/gates.tar.xz", "build-cuda-stage/cli.tar.xz"], timeout_s=450)
#   run(command="bash scripts/device_round.sh hybrid layers", carry=["build-cuda-stage/cli.tar.xz"])
# Steps (limit in seconds; carry):
#   gates     220  gates + cli   every device test (scripts/cuda_test.sh --on-device)
#   profile   170  cli           k3 bench --profile on gpu-bench: tg64 at 1 and 32, pp512, pp4096 (gpu_profile.sh, no ncu)
#   profncu   420  cli           the same with Nsight Compute's per-kernel times
#   layers    300  cli           true-width K3 layers (measure_gpu_layers.sh)
#   hybrid    265  cli           issue 20: hybrid overlap, hot-expert cache, k3 plan vs measured (measure_hybrid.sh)
#   long128k  170  cli           a 131,072-token prefill + decode on the long-1m model (long_prefill_gpu.sh)
#   long1m    420  cli           the 1,048,512-token prefill + 64 decode tokens (about 250 s on the H200)
#   kda131k   370  kda-bench + kda-wheels   our KDA beside fla at T 131072, H 12 (measure_kda_peers.sh)
#   kda       560  kda-bench + kda-wheels   every KDA shape beside the peers
#   klfull    580  cli           full-size Kimi Linear on the GPU (measure_kl_full.sh; needs 139 GiB: an H200;
#                                KL_EXPERTS=128 KL_TMPFS_SIZE=60G: the same shapes with 128 experts on an H100;
#                                KL_ONLY_BATCH=1 the batched bench alone; KL_NCU=1 a per-kernel table; ~160 s)
#   fp8prefill 240 cli           issue 20: FP8 trunk decode/prefill, hybrid prefill cpu/streamed/auto (measure_gpu_fp8_prefill.sh)
# Files written on the machine (/tmp/gpu-bench, /tmp/long-1m) stay while it is warm, so a later call
# on the same machine skips their generation. Limits: DEVICE_ROUND_LIMIT_<STEP>=seconds overrides one.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
final=${OUT:-build-cuda-stage/out}
mkdir -p "$final"
[[ $# -gt 0 ]] || { sed -n '2,24p' "$0"; exit 2; }
steps=" gates profile profncu layers hybrid long128k long1m kda131k kda klfull fp8prefill "
for s in "$@"; do  # every name checked before the first step spends device time
  [[ $steps == *" $s "* ]] || { echo "device_round.sh: unknown step '$s' (steps:$steps)"; exit 2; }
done
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2 var="DEVICE_ROUND_LIMIT_${1^^}"
  shift 2
  limit=${!var:-$limit}
  local dir=/tmp/device-round-$name t0 rc
  rm -rf "$dir" && mkdir -p "$dir"
  t0=$(date +%s)
  echo "=== $name (limit $limit s)"
  OUT=$dir timeout "$limit" "$@" >"$dir/stdout.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc in $(($(date +%s) - t0)) s$([[ $rc == 124 ]] && echo ' (time limit)')"
  tail -c "${DEVICE_ROUND_TAIL:-2500}" "$dir/stdout.log"
  tar -C "$dir" -cf "$final/$name.tar" .
}
for s in "$@"; do
  case $s in
    gates) step gates 220 bash scripts/cuda_test.sh --on-device ;;
    profile) step profile 170 env K3_SKIP_NCU=1 bash scripts/gpu_profile.sh ;;
    profncu) step profncu 420 bash scripts/gpu_profile.sh ;;
    layers) step layers 300 bash scripts/measure_gpu_layers.sh ;;
    hybrid) step hybrid 265 bash scripts/measure_hybrid.sh ;;
    long128k) step long128k 170 env LONG_TOKENS=131072 bash scripts/long_prefill_gpu.sh ;;
    long1m) step long1m 420 bash scripts/long_prefill_gpu.sh ;;
    kda131k) step kda131k 370 env KDA_CASES=prefill_T131072_H12 KDA_GATE=mild KDA_PEER_TIMEOUT=330 bash scripts/measure_kda_peers.sh ;;
    kda) step kda 560 bash scripts/measure_kda_peers.sh ;;
    klfull) step klfull 580 bash scripts/measure_kl_full.sh ;;
    fp8prefill) step fp8prefill 240 bash scripts/measure_gpu_fp8_prefill.sh ;;
    *) exit 2 ;;  # (checked above)
  esac
done
