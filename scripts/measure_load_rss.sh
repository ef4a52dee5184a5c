#!/usr/bin/env bash
# Writes docs/data/load_rss.json: resident memory after loading a generated ~1 GB K3-layout
# checkpoint (mmap, zero copies) vs its file size. Needs the tools venv (tools/setup_venv.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-build/venv/bin/python}
[[ -d build/mid1g ]] || "$py" tools/gen/gen_tiny_checkpoint.py --preset mid1g --seed 1 --out build/mid1g --no-reference
cmake -S . -B build >/dev/null && cmake --build build -j"$(nproc)" --target k3_load_rss >/dev/null
sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true  # cold page cache when permitted
mkdir -p docs/data
{
  echo "{\"command\": \"bash scripts/measure_load_rss.sh\", \"machine\": \"$(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB\", \"date\": \"$(date -u +%F)\","
  echo "\"result\": $(./build/bin/k3_load_rss build/mid1g)}"
} | python3 -m json.tool > docs/data/load_rss.json
cat docs/data/load_rss.json
