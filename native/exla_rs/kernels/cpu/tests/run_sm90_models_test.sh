#!/usr/bin/env bash
# Builds and runs the sm90 instruction-model tests (kernels/cpu/sm90_models.cpp): once optimised,
# once under AddressSanitizer + UndefinedBehaviorSanitizer; then, where emulate_wgmma.py's numpy
# is at hand, the cross-check against it. Usage: run_sm90_models_test.sh [python with numpy]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cxx="${CXX:-g++}"
out="${TMPDIR:-/tmp}/exla_rs_sm90_models.$$"
mkdir -p "$out"
trap 'rm -rf "$out"' EXIT
src=("$here/sm90_models_test.cpp" "$here/../sm90_models.cpp")
flags=(-std=c++17 -Wall -Wextra -Werror -I"$here/..")
"$cxx" "${flags[@]}" -O2 "${src[@]}" -o "$out/test" -lm
"$out/test"
"$cxx" "${flags[@]}" -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
  "${src[@]}" -o "$out/test_san" -lm
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "$out/test_san"
py="${1:-${PYTHON:-python3}}"
if "$py" -c 'import numpy' 2>/dev/null; then
  "$out/test" --dump "$out/dump.bin"
  "$py" "$here/sm90_models_crosscheck.py" "$out/dump.bin"
else
  echo "skip: no numpy for the emulate_wgmma.py cross-check ($py)"
fi
