#!/usr/bin/env bash
# True-width K3 layers on the GPU (issue 19, goal 6): one KDA + LatentMoE layer and one gated-MLA +
# LatentMoE layer at the released widths (tests/fixtures/k3-config-only; 896 experts viewed onto a
# pool of 64 distinct ones), decode at batch 1 and 32 (4096 cached tokens, CUDA graphs) and a
# 4096-token prefill, timed with device events and extrapolated to 93 layers + lm_head.
# Run on the GPU machine after `bash scripts/cuda_test.sh` packed build-cuda-stage/cli.tar.xz here
# (it carries bin/k3_layer_bench):
#   run(command="bash scripts/measure_gpu_layers.sh", carry=["build-cuda-stage/cli.tar.xz"])
# Writes $OUT/k3-layer-bench-gpu.json (-> docs/data/), and the log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
source scripts/lib/device_cli.sh
device_start || exit 2
bench=$(dirname "$k3")/k3_layer_bench
[[ -x $bench ]] || { echo "no k3_layer_bench in build-cuda-stage/cli.tar.xz (repack with scripts/cuda_test.sh)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$bench" --device cuda --config tests/fixtures/k3-config-only --expert-pool 64 --depth 4096 --prefill 4096 \
  --batch 1,32 -r 5 --numerics fast >"$out/k3-layer-bench-gpu.json" 2>"$out/k3-layer-bench-gpu.log" ||
  { tail -5 "$out/k3-layer-bench-gpu.log"; exit 1; }
python3 - "$out/k3-layer-bench-gpu.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"GPU {j.get('gpu')}: copy {j['roofline']['read_gbs']:.0f} GB/s")
for r in j["decode_by_batch"]:
    print(f"decode B={r['batch']:>3}: KDA layer {r['kda_layer_ms']:.3f} ms, MLA layer {r['mla_layer_ms']:.3f} ms, "
          f"lm_head {r['lm_head_ms']:.3f} ms -> 93 layers {r['step_s']*1e3:.1f} ms/step, {r['aggregate_tokens_per_s']:.1f} t/s")
e = j["extrapolated"]
print(f"B=1: {e['decode_fraction_of_read_bw']:.1%} of copy bandwidth; prefill {e['prefill_s_per_token']*1e3:.3f} ms/token")
PY
