#!/usr/bin/env bash
# CUDA backend tests in two halves, so the GPU machine only runs what was built here:
#   bash scripts/cuda_test.sh             here (nvcc, no GPU needed): builds build-cuda and packs
#                                         build-cuda-stage/gates.tar.xz (the device test binary),
#                                         tp.tar.xz (the third-party tiny fixture, ~7 MB: carried
#                                         when the checkout leaves room) and cli.tar.xz (the k3
#                                         binary and k3_layer_bench + the libedit libraries they
#                                         link, which the GPU machine's image may lack;
#                                         scripts/measure_cuda_perf.sh, gpu_profile.sh and
#                                         measure_gpu_layers.sh use it);
#   bash scripts/cuda_test.sh --on-device on the GPU machine: every device test (each kernel vs
#                                         its fp64 twin, the whole-model gates in fp32 and bf16,
#                                         graphs, device sessions), then a pass/fail table.
# With the `device` tool, one call:
#   run(command="bash scripts/cuda_test.sh --on-device",
#       carry=["build-cuda-stage/gates.tar.xz", "build-cuda-stage/tp.tar.xz"])
# (The checkout is ~57 MB of the tool's 64 MiB: gates + cli fit in one call, tp + gates in another;
# without tp.tar.xz the third-party gate skips with its message.) Results: $OUT (or build-cuda-stage/out): gtest JSON, the log, the table.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
stage=build-cuda-stage

if [[ "${1:-}" != "--on-device" ]]; then
  set -e
  command -v nvcc >/dev/null || { echo "cuda_test.sh: nvcc not found (install the CUDA toolkit)" >&2; exit 2; }
  # K3_MPI=OFF: the packed binaries must start on the GPU machine, whose image may lack the Open MPI libraries
  # (GPU ranks as processes start there with --rank/--world/--master instead: docs/multi-gpu.md).
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=ON -DK3_MPI=OFF -DK3_BUILD_TESTS=ON >/dev/null
  cmake --build build-cuda -j"$(nproc)" --target k3cli k3_cuda_tests k3_layer_bench
  rm -rf "$stage" build-cuda-pack
  mkdir -p "$stage" build-cuda-pack/gates build-cuda-pack/tp/shared/fixtures/third-party build-cuda-pack/cli
  cp build-cuda/tests/cuda/k3_cuda_tests build-cuda-pack/gates/
  cp build-cuda/bin/k3 build-cuda/bin/k3_layer_bench build-cuda-pack/cli/
  strip build-cuda-pack/gates/k3_cuda_tests build-cuda-pack/cli/k3 build-cuda-pack/cli/k3_layer_bench
  # libedit with its own libraries (the chat prompt), by the names k3 asks for.
  ldd build-cuda/bin/k3 | awk '/libedit|libbsd|libmd\.|libcpp-httplib|libbrotli/ {print $3}' | xargs -r -I{} cp -L {} build-cuda-pack/cli/
  if [[ -d ../shared/fixtures/third-party/kimi-k3-in-c-tiny ]]; then
    cp -r ../shared/fixtures/third-party/kimi-k3-in-c-tiny build-cuda-pack/tp/shared/fixtures/third-party/
  else
    echo "cuda_test.sh: ../shared absent: the third-party tiny gate will skip on the device" >&2
  fi
  for b in gates tp cli; do tar -C build-cuda-pack/$b -cf - . | xz -9 -T"$(nproc)" >"$stage/$b.tar.xz"; done
  rm -rf build-cuda-pack
  du -sh "$stage"/*.tar.xz
  echo "packed; on the GPU machine: bash scripts/cuda_test.sh --on-device (carry $stage/gates.tar.xz)"
  exit 0
fi

# ---------------------------------------------------------------- on the GPU machine
out=${OUT:-$stage/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=/tmp/k3-cuda-gates
rm -rf "$bin" && mkdir -p "$bin" && xz -dc "$stage/gates.tar.xz" | tar -C "$bin" -xf - ||
  { echo "cannot unpack $stage/gates.tar.xz (run bash scripts/cuda_test.sh here first)"; exit 2; }
if [[ -f $stage/tp.tar.xz ]]; then xz -dc "$stage/tp.tar.xz" | tar -C "$bin" -xf -; else
  echo "no $stage/tp.tar.xz carried: the third-party tiny gate skips"; fi
export K3_SOURCE_DIR=$root K3_SHARED_DIR=$bin/shared
nvidia-smi -L || true
"$bin/k3_cuda_tests" --gtest_output=json:"$out/gtest.json" >"$out/gtest.log" 2>&1
grep -E '^\[gate\]|Failure|exception' "$out/gtest.log" | head -150
python3 tools/gtest_table.py "$out/gtest.json" | tee "$out/table.md"
