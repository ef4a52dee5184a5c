#!/usr/bin/env bash
# Writes docs/data/model_gates.txt: engine decode paths vs the committed fp64 reference logits.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build >/dev/null && cmake --build build -j"$(nproc)" --target k3_gate_report >/dev/null
{
  echo "# bash scripts/measure_gates.sh on $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(date -u +%F)"
  for f in tests/fixtures/tiny tests/fixtures/tiny-flat tests/fixtures/tiny-chat; do ./build/bin/k3_gate_report "$f"; done
} | tee docs/data/model_gates.txt
