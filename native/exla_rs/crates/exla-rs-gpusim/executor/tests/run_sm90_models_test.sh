#!/usr/bin/env bash
# Builds and runs the sm90 instruction-model tests (executor/sm90_models.cpp): once optimised,
# once under AddressSanitizer + UndefinedBehaviorSanitizer. Usage: run_sm90_models_test.sh
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
