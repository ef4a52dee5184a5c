#!/usr/bin/env bash
# The "set up and run" command: installs dependencies, builds `k3` (build/bin/k3), prints the
# architecture of the bundled K3-nano model (models/k3-nano, trained here) and continues a prompt
# with it. Without a usable NVIDIA GPU (nvidia-smi absent or failing) the build is CPU-only
# (-DK3_CUDA=OFF), even where nvcc is installed; with one, the CUDA backend builds when nvcc is found.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
cuda=(-DK3_CUDA=OFF)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cuda=()  # the default: ON when nvcc is found
  echo "quickstart: NVIDIA GPU found; the CUDA backend builds if nvcc is present"
else
  echo "quickstart: no NVIDIA GPU (nvidia-smi); building the CPU engine only (-DK3_CUDA=OFF)"
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_TESTS=OFF "${cuda[@]}" >/dev/null
cmake --build build -j"$(nproc)" --target k3cli
./build/bin/k3 info --model models/k3-nano
echo
echo "\$ k3 run --numerics exact --seed 2 -n 80 --echo 'The function returns'     # the bundled K3-nano, no -m needed"
./build/bin/k3 run --numerics exact --seed 2 -n 80 --echo "The function returns"
echo
echo "quickstart: the binary is $root/build/bin/k3; to install it (with the bundled model):"
echo "  cmake --install build --prefix ~/.local    # then ~/.local/bin/k3"
