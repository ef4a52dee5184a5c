#!/usr/bin/env bash
# docs/server-page.png: the k3 serve chat page in headless Chromium after the browser test's two
# messages (a long reply stopped with Stop, then a short one), bundled K3-nano, this tree's build.
#   bash scripts/server_screenshot.sh [K3_BIN]     (default build/bin/k3; needs build/servevenv and
#                                                   scripts/test-deps.txt, as scripts/test.sh makes them)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
K3_BIN=${1:-build/bin/k3} K3_SCREENSHOT=docs/server-page.png build/servevenv/bin/python tests/server/test_browser.py
