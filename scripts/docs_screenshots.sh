#!/usr/bin/env bash
# Renders every page of the built hexdocs (doc/, from `mix docs`) with headless Chromium into
# PNGs, for a look at the docs before a release: scripts/docs_screenshots.sh [OUT_DIR] [PAGE...]
# (default: every page of doc/; OUT_DIR defaults to doc/screenshots, ignored with doc/).
# Needs Debian's `chromium` (apt-get install chromium); the tests do not.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/doc/screenshots}
shift || true
chromium=$(command -v chromium || command -v chromium-browser || true)
if [[ -z $chromium ]]; then
  echo "docs_screenshots.sh: no chromium on PATH (apt-get install chromium)" >&2
  exit 1
fi
[[ -f $root/doc/index.html ]] || { echo "docs_screenshots.sh: no doc/index.html: run mix docs first" >&2; exit 1; }
mkdir -p "$out"
pages=("$@")
if ((${#pages[@]} == 0)); then
  mapfile -t pages < <(cd "$root/doc" && ls *.html | grep -v -e '^404.html$' -e '^search.html$' -e '^index.html$')
fi
for page in "${pages[@]}"; do
  # The sidebar and code highlighting are drawn by JavaScript: give it time before the shot.
  "$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=5000 \
    --window-size=1280,2400 --screenshot="$out/${page%.html}.png" "file://$root/doc/$page" \
    >/dev/null 2>&1
  echo "$out/${page%.html}.png"
done
