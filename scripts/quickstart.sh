#!/usr/bin/env bash
# The "set up and run" command: installs dependencies, builds `k3`, prints the architecture of
# the bundled tiny K3-layout checkpoint and runs a text completion on it. (Until the trained
# default model lands, the tiny test checkpoint has random weights: its text is gibberish.)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target k3cli
model=tests/fixtures/tiny-chat
./build/bin/k3 info --model "$model"
echo "k3 run --seed 1 -n 32 --echo 'Once upon a time' (random weights: expect gibberish):"
./build/bin/k3 run --model "$model" --seed 1 -n 32 --echo "Once upon a time"
