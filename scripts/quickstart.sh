#!/usr/bin/env bash
# The "set up and run" command: installs dependencies, builds `k3`, prints the architecture of
# the bundled K3-nano model (models/k3-nano, trained here) and continues a prompt with it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target k3cli
./build/bin/k3 info --model models/k3-nano
echo
echo "\$ k3 run --echo 'The function returns'     # the bundled K3-nano, no -m needed"
./build/bin/k3 run --echo "The function returns"
