#!/usr/bin/env bash
# Peer comparison with llama.cpp's own Kimi K3 (or Kimi Linear) implementation (llama-cpp-python 0.3.36, which
# builds llama.cpp from source). Sets up build/peer-venv, fetches the sdist (for the vendored
# converter + gguf-py), converts the checkpoint to GGUF (cached in build/peer-gguf/), then runs
# tools/peer/llamacpp_bench.py (pp/tg throughput + logits cross-check against `k3 logits`).
#
# Usage: scripts/peer_llamacpp.sh [CKPT_DIR] [llamacpp_bench.py options...]
#        (default CKPT_DIR models/k3-nano; e.g. scripts/peer_llamacpp.sh models/k3-nano --with-k3 -r 3)
#        scripts/peer_llamacpp.sh --setup-only
# Environment:
#   PEER_VENV      venv directory (default build/peer-venv)
#   PEER_NICE      niceness of the conversion/benchmark run (default 19: the machine is shared)
#   K3_BIN         our k3 binary (default build/bin/k3, else build-peer/bin/k3, built here if missing)
#   TORCH_FROM     python of a venv that already has torch (default: build/venv, /tmp/k3venv);
#                  its site-packages are appended to the peer venv (a .pth file) instead of
#                  installing a second torch. TORCH_FROM=none forces a pip install of torch.
#   CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL   passed to the llama-cpp-python build
#                  (defaults -DGGML_NATIVE=ON and 2); the build runs under nice -n 19.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
ver=0.3.36
venv="${PEER_VENV:-$repo/build/peer-venv}"
src="$repo/build/peer-src"
llama_src="$src/llama_cpp_python-$ver/vendor/llama.cpp"
req="$repo/tools/peer/requirements.txt"
nice_n="${PEER_NICE:-19}"

# 1. venv + llama-cpp-python (compiles llama.cpp; ~30-40 min on 2 shared cores)
if [ ! -x "$venv/bin/python" ]; then
  echo "creating venv $venv" >&2
  python3 -m venv "$venv"
fi
stamp="$venv/.k3cpp-peer-requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$venv/bin/python" -c "import llama_cpp, transformers" 2>/dev/null; then
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  nice -n 19 "$venv/bin/python" -m pip install -r "$req"
  echo "$want" > "$stamp"
fi

# 2. torch for the converter
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  cand=()
  if [ -n "${TORCH_FROM:-}" ]; then cand=("$TORCH_FROM"); else cand=("$repo/build/venv/bin/python" /tmp/k3venv/bin/python); fi
  done_torch=0
  for py in "${cand[@]}"; do
    [ "$py" = none ] && break
    if [ -x "$py" ] && "$py" -c "import torch" 2>/dev/null; then
      site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      psite="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      echo "$site" > "$psite/zz_k3cpp_torch.pth"
      echo "peer venv: borrowing torch from $site" >&2
      done_torch=1
      break
    fi
  done
  if [ "$done_torch" = 0 ]; then
    nice -n 19 "$venv/bin/python" -m pip install -r "$repo/tools/peer/requirements-torch.txt"
  fi
  "$venv/bin/python" -c "import torch; print('torch', torch.__version__)" >&2
fi

# 3. sources of the vendored llama.cpp (converter + gguf-py) from the sdist
if [ ! -f "$llama_src/convert_hf_to_gguf.py" ]; then
  mkdir -p "$src"
  "$venv/bin/python" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$ver" -d "$src"
  tar -xzf "$src/llama_cpp_python-$ver.tar.gz" -C "$src"
fi

[ "${1:-}" = "--setup-only" ] && { echo "peer setup done: $venv, $llama_src" >&2; exit 0; }

# 4. our engine (for the cross-check / --with-k3); K3_BIN names one that is already built
k3_arg=()
if [ -n "${K3_BIN:-}" ]; then
  k3_arg=(--k3 "$K3_BIN")
elif [ ! -x build/bin/k3 ] && [ ! -x build-peer/bin/k3 ]; then
  cmake -S . -B build-peer -DCMAKE_BUILD_TYPE=Release
  nice -n 19 cmake --build build-peer -j2 --target k3cli
fi

# 5. convert (cached) + bench + cross-check
ckpt="models/k3-nano"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then ckpt="$1"; shift; fi
exec nice -n "$nice_n" "$venv/bin/python" tools/peer/llamacpp_bench.py "$ckpt" --llama-src "$llama_src" "${k3_arg[@]}" "$@"
