#!/usr/bin/env bash
# Create (or update) the Python venv for the k3cpp tools and install tools/requirements.txt.
# Usage: tools/setup_venv.sh [VENV_DIR]      (default: build/venv under the repository root)
# Idempotent: an existing venv is reused; pip skips requirements that are already satisfied.
# Environment: PYTHON (default python3), PIP_EXTRA_ARGS (e.g. "--index-url ..." for a CPU-only
# torch wheel index), KIMI_LINEAR=1 (also install tools/reference/requirements-kimi-linear.txt:
# transformers for the Kimi Linear fixtures, with --no-deps, see that file).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
venv="${1:-$repo/build/venv}"
py="${PYTHON:-python3}"
req="$here/requirements.txt"
kl_req="$here/reference/requirements-kimi-linear.txt"

if [ ! -x "$venv/bin/python" ]; then
  echo "creating venv $venv"
  "$py" -m venv "$venv"
fi
stamp="$venv/.k3cpp-requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ "${KIMI_LINEAR:-0}" = 1 ]; then
  want="$want+kl:$(sha256sum "$kl_req" | cut -d' ' -f1)"
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import numpy, safetensors, torch" 2>/dev/null; then
  echo "venv $venv is up to date"
  exit 0
fi
"$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
# shellcheck disable=SC2086
"$venv/bin/python" -m pip install --disable-pip-version-check -r "$req" ${PIP_EXTRA_ARGS:-}
if [ "${KIMI_LINEAR:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --disable-pip-version-check --no-deps -r "$kl_req" ${PIP_EXTRA_ARGS:-}
fi
echo "$want" > "$stamp"
"$venv/bin/python" -c "import numpy, safetensors, torch; print('numpy', numpy.__version__, 'safetensors', safetensors.__version__, 'torch', torch.__version__)"
