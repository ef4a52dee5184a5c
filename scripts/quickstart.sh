#!/usr/bin/env bash
# The "set up and run" command: installs dependencies, builds `k3`, prints the architecture of
# the bundled tiny K3-layout checkpoint and greedily generates from it. (Until the trained default
# model lands, the tiny test checkpoint with random weights is what runs: its tokens are ids.)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target k3cli
model=tests/fixtures/tiny
./build/bin/k3 info --model "$model"
echo "greedy continuation of ids 1,2,3,4,5,6,7,8:"
./build/bin/k3 generate --model "$model" --ids 1,2,3,4,5,6,7,8 -n 16 --greedy --print-ids
