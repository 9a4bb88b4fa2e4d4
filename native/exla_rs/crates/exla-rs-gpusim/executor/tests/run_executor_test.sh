#!/usr/bin/env bash
# Builds and runs the executor's own tests (executor_test.cpp): the PTX models against
# independent references, the executor's checks and the kernels' mask intervals (common.cuh),
# optimised; then the kernels a sanitizer must
# stop: an unordered shared-memory write and two blocks' stores to one global word under
# ThreadSanitizer (each with an ordered twin, which must pass) and a store past the dynamic
# shared memory under AddressSanitizer.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cpu="$here/.."            # the executor's C++
crate="$here/../.."       # its headers as the kernels include them: "executor/....hpp"
kernels="$crate/../../kernels"
cxx="${CXX:-g++}"
out="${TMPDIR:-/tmp}/exla_rs_executor_test.$$"
mkdir -p "$out"
trap 'rm -rf "$out"' EXIT
# -Wno-unknown-pragmas: the kernels' #pragma unroll (common.cuh, for the Mask test), which g++ ignores.
common=(-std=c++17 -DEXLA_RS_CPU -Wall -Wno-unused-function -Wno-unknown-pragmas -mf16c -I"$cpu" -I"$crate" -I"$kernels")
core=("$cpu/runtime.cpp" "$cpu/fiber.cpp")

# build NAME SANITIZER: the test with its kernels instrumented, the core not (as the library builds it).
build() {
  local name=$1 san=$2 def=()
  [[ $san == thread ]] && def=(-DEXLA_RS_GPUSIM_TSAN)
  [[ $san == address ]] && def=(-DEXLA_RS_GPUSIM_ASAN)
  local inst=() link=()
  [[ -n $san ]] && inst=(-fsanitize="$san" -fno-omit-frame-pointer) && link=(-fsanitize="$san")
  "$cxx" "${common[@]}" "${def[@]}" -O2 -g -c "${core[0]}" -o "$out/$name.runtime.o"
  "$cxx" "${common[@]}" "${def[@]}" -O2 -g -c "${core[1]}" -o "$out/$name.fiber.o"
  "$cxx" "${common[@]}" "${def[@]}" -O1 -g "${inst[@]}" -c "$here/executor_test.cpp" -o "$out/$name.test.o"
  "$cxx" "${link[@]}" "$out/$name.test.o" "$out/$name.runtime.o" "$out/$name.fiber.o" -o "$out/$name" -lm
}

build plain ""
"$out/plain"

build tsan thread
# expect_caught BINARY ARG TOOL WORDS: the run must fail and its report must name the tool's finding.
expect_caught() {
  local bin=$1 arg=$2 words=$3 log="$out/${2#--}.log"
  if "$bin" "$arg" >"$log" 2>&1; then
    echo "FAIL: $arg ran clean under $(basename "$bin"): the sanitizer missed it"; cat "$log"; exit 1
  fi
  grep -q "$words" "$log" || { echo "FAIL: $arg failed without \"$words\""; cat "$log"; exit 1; }
  echo "ok: $arg caught ($words)"
}
TSAN_OPTIONS="halt_on_error=1 exitcode=66" expect_caught "$out/tsan" --race "ThreadSanitizer: data race"
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$out/tsan" --ordered | grep -q "ran" && echo "ok: --ordered clean under ThreadSanitizer"
# Two blocks storing to one global word race, whatever each block's barrier orders inside it.
TSAN_OPTIONS="halt_on_error=1 exitcode=66" expect_caught "$out/tsan" --block_race "ThreadSanitizer: data race"
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$out/tsan" --block_ordered | grep -q "ran" && echo "ok: --block_ordered clean under ThreadSanitizer"
# Two copy-engine copies delivered in one call, in two engine contexts, into disjoint spans.
TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$out/tsan" --two_copies | grep -q "ran" && echo "ok: --two_copies clean under ThreadSanitizer"
build asan address
ASAN_OPTIONS="detect_leaks=0" expect_caught "$out/asan" --oob "AddressSanitizer: heap-buffer-overflow"
echo "executor tests: all passed"
