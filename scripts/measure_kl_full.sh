#!/usr/bin/env bash
# Issue 21 on the GPU machine: a full-size random-weight Kimi Linear (the released 48B-A3B shapes,
# bf16, ~98 GB: tools/gen/gen_kimi_linear.py --preset kl-full) on one H200: decode at batch 1 against
# the copy-bandwidth roofline (k3 bench's roofline column), prefill pp4096, and aggregate decode at
# 32 and 128 sequences.
# Run on the GPU machine after `bash scripts/cuda_test.sh` packed build-cuda-stage/cli.tar.xz here:
#   run(command="bash scripts/measure_kl_full.sh", carry=["build-cuda-stage/cli.tar.xz"])
# Where the 98 GB go: the one-GPU machine has 64 GiB of disk and 128 GiB of memory, so the checkpoint
# is written to a memory file system (a tmpfs of KL_TMPFS_SIZE, default 110G, mounted at KL_DIR's
# parent; the engine maps the files from there and uploads them once). It needs root to mount; when
# that fails the script says so and stops (a machine with 128 GiB of disk, nvidia-h200-x2, can use
# KL_DIR on its disk with KL_TMPFS_SIZE=0). KL_JOBS: shards written at once (default 4; each holds one
# layer, ~3.6 GB). The weights are drawn by torch's generator on the GPU (gen_kimi_linear.py
# --torch-device cuda; KL_GEN_DEVICE= for numpy, many minutes on 16 cores).
# KL_EXPERTS=N: N routed experts per layer instead of 256 (the same bytes per batch-1 decode step;
# 128 -> 51 GB, which an 80 GB H100 holds); its files are named kl-full-eN-*.
# Writes $OUT (or build-cuda-stage/out): kl-full[-eN]-{info.txt,bench.json/.md,batch.json/.md}, the log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
dir=${KL_DIR:-/mnt/kl/kl-full}
size=${KL_TMPFS_SIZE:-110G}
jobs=${KL_JOBS:-4}
gen_device=${KL_GEN_DEVICE-cuda}
experts=${KL_EXPERTS:-}
tag=kl-full${experts:+-e$experts}
[[ -n $experts ]] && dir=${KL_DIR:-/mnt/kl/$tag}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
free -g | head -2
if [[ $size != 0 ]]; then
  mkdir -p "$(dirname "$dir")"
  mountpoint -q "$(dirname "$dir")" || mount -t tmpfs -o size="$size" tmpfs "$(dirname "$dir")" ||
    { echo "measure_kl_full.sh: cannot mount a $size tmpfs at $(dirname "$dir") (needs root); see the header"; exit 2; }
  df -h "$(dirname "$dir")" | tail -1
fi
if [[ ! -f $dir/config.json ]]; then
  t0=$(date +%s)
  python3 tools/gen/gen_kimi_linear.py --preset kl-full --seed 1 --out "$dir" --jobs "$jobs" \
    ${gen_device:+--torch-device "$gen_device"} ${experts:+--experts "$experts"} >/tmp/kl-gen.log 2>&1 ||
    { tail -5 /tmp/kl-gen.log; exit 1; }
  echo "generated $tag in $(($(date +%s) - t0)) s: $(du -sh "$dir" | cut -f1)"
fi
"$k3" info -m "$dir" --ctx 4224 --ubatch 4096 | tee "$out/$tag-info.txt" | tail -12
# Batch 1: pp4096 and tg128 (roofline column), graphs on and off; then decode aggregates at 32 and
# 128; each with the per-op table of one more profiled run.
# KL_ONLY_BATCH=1: the second bench alone.
[[ ${KL_ONLY_BATCH:-0} == 1 ]] ||
  "$k3" bench -m "$dir" --device cuda -p 4096 -n 128 -r 3 --ubatch 4096 --profile --no-progress \
    --json-out "$out/$tag-bench.json" 2>"$out/$tag-bench.log" | tee "$out/$tag-bench.md"
"$k3" bench -m "$dir" --device cuda -p 0 -n 64 -d 512 -b 1,32,128 -r 3 --profile --no-progress \
  --json-out "$out/$tag-batch.json" 2>>"$out/$tag-bench.log" | tee "$out/$tag-batch.md"
tail -5 "$out/$tag-bench.log"
# KL_NCU=1: every kernel of a few decode steps timed alone by Nsight Compute (batch 1 and 32 sequences),
# the per-kernel table beside the batch bench's graph-replayed steps ($tag-kernels.md/.json).
if [[ ${KL_NCU:-0} == 1 ]]; then
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  [[ -x $ncu ]] || { echo "measure_kl_full.sh: ncu not found"; exit 2; }
  python3 -c "import random;r=random.Random(8);[print(','.join(str(r.randrange(1,32000)) for _ in range(4))) for _ in range(32)]" >/tmp/kl-ids32.txt
  t0=$(date +%s)
  for w in "decode1 --ids 17 -n 4" "decode32 --ids-file /tmp/kl-ids32.txt -n 3"; do
    set -- $w
    name=$1
    shift
    timeout "${KL_NCU_TIMEOUT:-200}" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      "$k3" generate -m "$dir" --device cuda "$@" >"/tmp/ncu-kl-$name.csv" 2>"/tmp/ncu-kl-$name.err" ||
      { echo "ncu $name failed"; tail -5 "/tmp/ncu-kl-$name.err"; }
  done
  echo "ncu: $(($(date +%s) - t0)) s"
  python3 tools/gpu_profile_table.py --bench "$out/$tag-batch.json" decode1=/tmp/ncu-kl-decode1.csv \
    decode32=/tmp/ncu-kl-decode32.csv --json "$out/$tag-kernels.json" | tee "$out/$tag-kernels.md" | head -60
fi
