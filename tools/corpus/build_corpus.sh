#!/usr/bin/env bash
# Builds the K3-nano corpus: build/corpus/train.txt, build/corpus/valid.txt,
# models/k3-nano/corpus-manifest.json and docs/data/k3-nano-corpus.json.
# Usage (from anywhere): tools/corpus/build_corpus.sh
#
# 1. fetches the pinned Debian 12 .debs below into build/corpus/debs with `apt-get download`
#    (no install, nothing outside build/ is touched; runs `apt-get update` once if a pin is not found);
# 2. creates the venv build/corpus/venv with tools/corpus/requirements.txt (tiktoken, regex: used by the
#    later steps, train_nano_vocab.py and encode_corpus.py);
# 3. runs tools/corpus/build_corpus.py (standard library only; extracts the .debs with dpkg-deb -x).
# Deterministic: the same .debs give byte-identical outputs (sha256 in the manifest).
# If Debian has retired a pinned version (point/security update), `apt-get download` fails: update the
# pin here and in SOURCES of build_corpus.py; the manifest then records the new text hashes.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$repo/build/corpus"
debs="$out/debs"
venv="$out/venv"

PKGS=(
  python3.11-doc=3.11.2-6+deb12u9
  postgresql-doc-15=15.20-0+deb12u1
  python-django-doc=3:3.2.25-0+deb12u7
  sqlite3-doc=3.40.1-2+deb12u2
  rust-doc=1.63.0+dfsg1-2
  llvm-15-doc=1:15.0.6-4
  clang-15-doc=1:15.0.6-4
  nodejs-doc=18.20.4+dfsg-1~deb12u3
  sphinx-doc=5.3.0-4
  python-sqlalchemy-doc=1.4.46+ds1-1
  python-flask-doc=2.2.2-3
  cmake-doc=3.25.1-1
  cmake-data=3.25.1-1
  apache2-doc=2.4.71-1~deb12u1
  erlang-doc=1:25.2.3+dfsg-1+deb12u4
  golang-1.19-doc=1.19.8-2
  python-sklearn-doc=1.2.1+dfsg-1
  python-pandas-doc=1.5.3+dfsg-2
  python-scipy-doc=1.10.1-2
  python-sympy-doc=1.11.1-1
  dict-jargon=4.4.7-3.1
  dict-devil=1.0-13.1
)

mkdir -p "$debs"
missing=()
for pv in "${PKGS[@]}"; do
  name="${pv%%=*}"; ver="${pv#*=}"
  [ -f "$debs/${name}_${ver//:/%3a}_all.deb" ] || missing+=("$pv")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "fetching ${#missing[@]} pinned .deb(s) into $debs"
  # apt-get download writes into the current directory; -o quiets the _apt sandbox warning as root
  if ! (cd "$debs" && apt-get download -q -o APT::Sandbox::User=root "${missing[@]}"); then
    echo "apt-get download failed; running apt-get update once and retrying"
    apt-get update -q
    (cd "$debs" && apt-get download -q -o APT::Sandbox::User=root "${missing[@]}")
  fi
fi

req="$here/requirements.txt"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -r "$req"
  echo "$want" > "$stamp"
fi

exec "$venv/bin/python" "$here/build_corpus.py" --debs "$debs" --out "$out" "$@"
