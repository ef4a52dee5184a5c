#!/usr/bin/env bash
# Our CUDA KDA kernels beside FlashKDA and fla in one device call (issue 19, goal 4): chunked prefill at
# B=1, D=128 for (T, H) in (8192, 96), (8192, 64), (16384, 64), (32768, 12), (131072, 12), varlen
# 8 x 1024 tokens at H=96, and recurrent decode of 64 sequences at H=96 (GB/s of fp32 state), each
# under two gate distributions; then a correctness check of the peers against our dumped small cases.
# Two halves, so the GPU machine only runs what was built here:
#   bash scripts/measure_kda_peers.sh --pack   here (nvcc, no GPU): builds k3_kda_gpu_bench in
#       build-kdabench (only the kda/elementwise kernel files: K3_CUDA_SOURCES_GLOB) and packs
#       build-kdabench-stage/kda-bench.tar.xz (the stripped binary; it links only system libraries);
#       downloads the peers' wheels for the device (CPython 3.12, manylinux x86_64, no dependencies:
#       torch, triton and einops are on the device image) and packs them, stored uncompressed inside
#       one xz archive, as build-kdabench-stage/kda-wheels.tar.xz (FlashKDA's wheel alone is 7.2 MB
#       deflated; 2.9 MB this way).
#   bash scripts/measure_kda_peers.sh          on the GPU machine:
#   run(command="bash scripts/measure_kda_peers.sh",
#       carry=["build-kdabench-stage/kda-bench.tar.xz", "build-kdabench-stage/kda-wheels.tar.xz"])
# Writes $OUT (or build-kdabench-stage/out): kda-ours.json/.log, kda-peers.json/.log,
# kda-peers-gpu.json (-> docs/data/) and kda-peers-gpu.md (tools/kda_peer_table.py), and prints the table.
# Knobs (environment): KDA_REPS (20), KDA_WARMUP (3), KDA_CASES (all), KDA_GATE (both),
# KDA_PEER_TIMEOUT (seconds for the peers' half, 420: Triton compiles on first use).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
stage=build-kdabench-stage
FLA_VERSION=0.6.0
FLASHKDA_VERSION=0.0.1.post20260901

if [[ "${1:-}" == "--pack" ]]; then
  set -e
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  command -v nvcc >/dev/null || { echo "measure_kda_peers.sh: nvcc not found" >&2; exit 2; }
  cmake -S . -B build-kdabench -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=ON -DK3_WERROR=ON -DK3_BUILD_TESTS=OFF \
    "-DK3_CUDA_SOURCES_GLOB=[ek][dl]*.cu" >/dev/null
  cmake --build build-kdabench -j"$(nproc)" --target k3_kda_gpu_bench
  rm -rf "$stage/pack" && mkdir -p "$stage/pack/bin" "$stage/dl"
  cp build-kdabench/bin/k3_kda_gpu_bench "$stage/pack/bin/"
  strip "$stage/pack/bin/k3_kda_gpu_bench"
  if ldd "$stage/pack/bin/k3_kda_gpu_bench" | grep -vE 'linux-vdso|libstdc\+\+|libm\.|libgcc_s|libc\.|ld-linux' | grep -q '=>'; then
    echo "measure_kda_peers.sh: k3_kda_gpu_bench links a library beyond the system ones:" >&2
    ldd "$stage/pack/bin/k3_kda_gpu_bench" >&2
    exit 1
  fi
  tar -C "$stage/pack" -cf - bin | xz -9 -T"$(nproc)" >"$stage/kda-bench.tar.xz"
  # Peer wheels for the device's Python (KINDS.md: CPython 3.12, torch 2.11 cu130, triton 3.6, einops).
  py=python3
  [[ -x build/peer-venv/bin/python ]] && py=build/peer-venv/bin/python
  plat=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_24_x86_64 linux_x86_64 any; do plat+=(--platform "$p"); done
  for w in "fla-core==$FLA_VERSION" "tokenspeed-flashkda==$FLASHKDA_VERSION"; do
    name=${w%%==*}; ver=${w##*==}
    ls "$stage/dl/${name//-/_}-$ver-"*.whl >/dev/null 2>&1 && continue
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
      -d "$stage/dl" "$w"
  done
  # A wheel is a zip; xz cannot shrink deflated members, so re-store each wheel's members uncompressed
  # (same files, same RECORD hashes: pip installs it as before) and let xz compress the lot.
  rm -rf "$stage/wheels" && mkdir -p "$stage/wheels"
  "$py" - "$stage/dl" "$stage/wheels" "$FLA_VERSION" "$FLASHKDA_VERSION" <<'PY'
import glob, os, sys, zipfile
src, dst, fla_v, fk_v = sys.argv[1:]
for pat in (f"fla_core-{fla_v}-*.whl", f"tokenspeed_flashkda-{fk_v}-*.whl"):
    (w,) = glob.glob(os.path.join(src, pat))
    with zipfile.ZipFile(w) as zi, zipfile.ZipFile(os.path.join(dst, os.path.basename(w)), "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            data = zi.read(info)
            info.compress_type = zipfile.ZIP_STORED
            zo.writestr(info, data)
PY
  tar -C "$stage" -cf - wheels | xz -9e -T"$(nproc)" >"$stage/kda-wheels.tar.xz"
  for w in "$stage/dl"/*.whl; do echo "  wheel as downloaded: $(stat -c %s "$w") bytes $(basename "$w")"; done
  du -b "$stage/kda-bench.tar.xz" "$stage/kda-wheels.tar.xz"
  echo "packed; on the GPU machine: bash scripts/measure_kda_peers.sh" \
    "(carry $stage/kda-bench.tar.xz and $stage/kda-wheels.tar.xz)"
  exit 0
fi

# ---------------------------------------------------------------- on the GPU machine
out=${OUT:-$stage/out}
mkdir -p "$out"
reps=${KDA_REPS:-20} warmup=${KDA_WARMUP:-3} cases=${KDA_CASES:-all} gate=${KDA_GATE:-both}
peer_timeout=${KDA_PEER_TIMEOUT:-420}
bin=/tmp/k3-kda-bench site=/tmp/kda-peer-site dump=/tmp/kda-dump
rm -rf "$bin" "$site" "$dump" /tmp/kda-wheels && mkdir -p "$bin" "$site"
xz -dc "$stage/kda-bench.tar.xz" | tar -C "$bin" -xf - ||
  { echo "cannot unpack $stage/kda-bench.tar.xz (run bash scripts/measure_kda_peers.sh --pack here first)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The device's python3 is itself a virtual environment (/opt/torch/.venv): a venv made from it with
# --system-site-packages would see the base interpreter's packages, not its torch. So the wheels go
# into a folder on PYTHONPATH instead (what the device README does).
peers_ok=1
mkdir -p /tmp/kda-wheels
if xz -dc "$stage/kda-wheels.tar.xz" 2>/dev/null | tar -C /tmp/kda-wheels -xf - && ls /tmp/kda-wheels/wheels/*.whl >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    /tmp/kda-wheels/wheels/*.whl || { echo "pip could not install the peer wheels"; peers_ok=0; }
else
  echo "no $stage/kda-wheels.tar.xz carried: peers not measured"; peers_ok=0
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} FLA_DISABLE_BACKEND_DISPATCH=1 PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' || true

t0=$(date +%s)
"$bin/bin/k3_kda_gpu_bench" --cases "$cases" --gate "$gate" --reps "$reps" --warmup "$warmup" \
  --dump "$dump" --dump-T 512 --dump-H 4 >"$out/kda-ours.json" 2>"$out/kda-ours.log" ||
  { echo "k3_kda_gpu_bench failed:"; tail -5 "$out/kda-ours.log"; exit 1; }
echo "ours: $(($(date +%s) - t0)) s"
t0=$(date +%s)
if ((peers_ok)); then
  timeout "$peer_timeout" python3 tools/peer/kda_peers.py --cases "$cases" --gate "$gate" --fla-cases "${KDA_FLA_CASES:-all}" --reps "$reps" \
    --warmup "$warmup" --dump "$dump" --out "$out/kda-peers.json" 2>"$out/kda-peers.log"
  rc=$?
  ((rc == 0)) || { echo "kda_peers.py exit $rc (124: stopped after ${peer_timeout} s; partial results kept)"; tail -8 "$out/kda-peers.log"; }
  grep -E 'available|unavailable|FAILED|check ' "$out/kda-peers.log" | head -40
fi
echo "peers: $(($(date +%s) - t0)) s"
python3 tools/kda_peer_table.py merge "$out/kda-ours.json" "$out/kda-peers.json" -o "$out/kda-peers-gpu.json" &&
  python3 tools/kda_peer_table.py table "$out/kda-peers-gpu.json" -o "$out/kda-peers-gpu.md" &&
  cat "$out/kda-peers-gpu.md"
