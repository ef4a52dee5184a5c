#!/usr/bin/env bash
# k3 plan on the released K3 config (tests/fixtures/k3-config-only) for issue 20's three machines
# and issue 23's 2 x 8 H200 (TP16/EP16, and the one-node hybrid alternative), written as
# docs/data/plan-*.json; then tools/plan/plan_summary.py writes docs/data/plan-summary.md and the
# check of the planner against the recorded true-width layer bench (docs/data/plan-check-layer-bench.json).
# (b) also at batch 32, to record that it does not fit the H100 beside the FP8 trunk.
# Predictions only: nothing here runs the model. Usage: bash scripts/plan_full_k3.sh [K3_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
K3=${1:-${K3:-build/bin/k3}}
CFG=tests/fixtures/k3-config-only
REC=docs/data/calibration-h200-recorded.json
OUT=docs/data
[ -x "$K3" ] || { echo "plan_full_k3.sh: no k3 binary at $K3 (build it, or pass its path)" >&2; exit 2; }
# The GPU rates of the H200 from the recorded runs (the GPU records and k3 info's parameter counts).
python3 tools/plan/calibration_from_records.py --k3 "$K3" --out "$REC"

# A 2-socket DDR5 server: 2 x 12 channels of DDR5-4800 (AMD EPYC 9004, 12 channels per socket) =
# 24 x 4800 MT/s x 8 B = 921.6 GB/s nominal (the planner applies its 0.70 efficiency), 2 x 48
# cores, 24 x 64 GiB = 1.5 TiB, one PCIe 4.0 NVMe at 7 GB/s.
SERVER="--ram 1.5T --cpu-bw 921.6G --cores 96 --disk 7G"
# A DGX/HGX H200 node's host: 2 TB, 2 x 56 cores, 2 x 8 channels of DDR5-4800 = 614.4 GB/s.
DGX="--ram 2T --cpu-bw 614.4G --cores 112 --disk 7G"
COMMON="--config $CFG --ctx 4096 --prompt 4096 --json"

run() {  # run NAME ARGS...: one plan, JSON into docs/data/plan-NAME.json
  local name=$1
  shift
  echo "k3 plan $* > $OUT/plan-$name.json" >&2
  "$K3" plan $COMMON "$@" > "$OUT/plan-$name.json"
}
# (a) 1 x H200 + the 2-socket DDR5 server, GPU rates from the recorded H200 runs.
run a-h200-ddr5 --gpus 1xH200 $SERVER --calibration $REC --batch 32
# (a) with the CPU's experts in 8-bit activations (k3 run --cpu-experts-q8): the fast expert GEMV rate.
run a-h200-ddr5-q8 --gpus 1xH200 $SERVER --calibration $REC --batch 32 --cpu-experts-q8
# (b) 1 x H100 80 GB with the FP8 trunk (planned: k3 run has no FP8 trunk yet), same host; no H100
#     record exists, so its rates are nominal (datasheet x the efficiencies the H200 records showed).
#     Batch 8: the fp32 state of 32 sequences (22 GB at 4096 tokens) does not fit beside the trunk.
run b-h100-fp8 --gpus 1xH100-80G $SERVER --trunk-fp8 --batch 8
# (c) CPU only, 1.5 TiB of RAM; and (c') with 1.5e12 bytes (decimal 1.5 TB = 1397 GiB).
run c-cpu-1.5tib --gpus none $SERVER --batch 32
run c-cpu-1.5e12 --gpus none --ram 1397G --cpu-bw 921.6G --cores 96 --disk 7G --batch 32
# (c-amx) CPU only on a 2-socket Xeon with AMX tiles (2 x 56-core Xeon Platinum 8480+, 2 x 8 channels of
#     DDR5-4800 = 614.4 GB/s, 1.5 TiB): the prefill GEMMs at the amx level's per-core rates.
run c-cpu-xeon-amx --gpus none --ram 1.5T --cpu-bw 614.4G --cores 112 --disk 7G --cpu-isa amx --batch 32
# Issue 23: 2 nodes x 8 H200, TP16 / EP16 over NVLink + InfiniBand NDR (50 GB/s per GPU).
run tp16-ep16-2x8h200 --nodes 2 --gpus 8xH200 --tp 16 --ep 16 $DGX --calibration $REC --batch 32
# (b) at batch 32: the planner falls back to CPU only (recorded to show why).
run b-h100-fp8-batch32 --gpus 1xH100-80G $SERVER --trunk-fp8 --batch 32
# The hybrid alternative: one 8 x H200 node (1.13 TB of HBM < 1.56 TB), the planner choosing.
run hybrid-1x8h200 --gpus 8xH200 $DGX --calibration $REC --batch 32

python3 tools/plan/plan_summary.py
