#!/usr/bin/env bash
# Writes docs/data/k3-nano-samples.txt: continuations by the bundled K3-nano (models/k3-nano) with
# its generation_config.json sampling, fixed seeds and --numerics exact (the same text on every CPU),
# so the README's sample can be regenerated anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build >/dev/null && cmake --build build -j"$(nproc)" --target k3cli >/dev/null
out=docs/data/k3-nano-samples.txt
{
  echo "# bash scripts/k3_nano_samples.sh on $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(date -u +%F)"
  echo "# k3 run -m models/k3-nano --numerics exact --seed S -n 80 --echo PROMPT   (sampling from generation_config.json)"
  for s in "1|Once upon a time" "2|The function returns" "3|To install the package, run" "4|In this chapter we describe"; do
    seed=${s%%|*} prompt=${s#*|}
    echo
    echo "## seed $seed: \"$prompt\""
    ./build/bin/k3 run -m models/k3-nano --numerics exact --seed "$seed" -n 80 -q --echo "$prompt" 2>/dev/null
    echo
  done
} > "$out"
cat "$out"
