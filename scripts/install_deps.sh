#!/usr/bin/env bash
# Installs the Debian packages listed in scripts/deps.txt (or the list given as $1, e.g.
# scripts/test-deps.txt) (root or sudo). Skips apt entirely when every package is already present at
# the pinned version, so repeated runs are fast and offline.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
list=${1:-$here/deps.txt}
mapfile -t pkgs < <(grep -v '^\s*#' "$list" | grep -v '^\s*$')
missing=()
for p in "${pkgs[@]}"; do
  name=${p%%=*}
  want=${p#*=}
  have=$(dpkg-query -W -f='${Version}' "$name" 2>/dev/null || true)
  if [[ -z "$have" || ( "$p" == *=* && "$have" != "$want" ) ]]; then missing+=("$p"); fi
done
if ((${#missing[@]} == 0)); then
  echo "deps: all ${#pkgs[@]} packages present"
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; fi
echo "deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
