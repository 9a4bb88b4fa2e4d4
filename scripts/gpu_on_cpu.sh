#!/usr/bin/env bash
# The CUDA kernels run on the CPU with the GPU's semantics (issue 22): the GPU-on-CPU executor
# (native/exla_rs/crates/exla-rs-gpusim: its C++ in executor/, its Rust face a LaunchTarget) behind
# exla-rs-cuda's unchanged launch code.
#
#   scripts/gpu_on_cpu.sh [STEP ...]     default: every step below except mutations, in order
#   scripts/gpu_on_cpu.sh --mutations    the mutation proof only (scripts/gpu_on_cpu_mutations.py)
#
# Steps:
#   build        the gpu-on-cpu handler library (exla-rs-xla --features gpu-on-cpu) in its own
#                target dir, so the release library never carries the executor
#   rust         the executor crate's tests (exla-rs-cuda's launch code on Stream::Target(&SimDevice) vs
#                the Host kernels) and exla-rs-xla's cuda_on_cpu handler tests
#   tests-mma    test/gpu through real XLA (jax 0.10.2, cpu device) on the mma.sync kernel set
#                (EXLA_RS_CUDA_PATH=mma: the executor is a 9.0 device, where auto runs sm90 for some calls)
#   tests-sm90   the same with EXLA_RS_CUDA_PATH=sm90 (the sm90 forward wherever it applies)
#   tsan         the sanitizer harness (examples/gpu_on_cpu_check: every kernel image) with the
#   asan         executor and kernels built under ThreadSanitizer / AddressSanitizer
#   mutations    each planted kernel bug must be caught by its named check, the tree must pass
#   stats        shared-memory bank conflicts per kernel (bench/bank_conflicts.py) on the
#                statistics build of the library (ld/st.shared counted too), target dir gpu_on_cpu_stats; and the
#                global bytes of decode calls (bench/decode_traffic.py: the split-KV path reads K/V once)
#
# Each step's output goes to $EXLA_RS_GPUSIM_LOGS (default: a temporary directory; shown in full
# when the step fails); each prints its time and test counts, and the script ends with
# `N passed, N failed` over every step. Exit status: non-zero when any step fails.
#
# Knobs: EXLA_RS_GPUSIM_MAX_SEQ (longest sequence test/gpu keeps on the CPU, default 160: above
# the kernels' largest tile, 128 rows), EXLA_RS_SEED (replays test inputs), EXLA_RS_GPUSIM_JOBS
# (test/gpu's mma.sync and sm90 runs in that many shards side by side, default 2).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

TARGET=$EXLA_RS_ROOT/native/exla_rs/target
PY=$EXLA_RS_VENVS/jax-0.10.2/bin/python
LIB=$TARGET/gpu_on_cpu/gpusim/libexla_rs_xla.so
LOGS=${EXLA_RS_GPUSIM_LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
# No fatbins unless the caller says otherwise: the executor runs the kernels' C++ build, nvcc
# would only add minutes. (scripts/test.sh says on: its cargo test shares this target dir, with
# the fatbins its release build's nvcc cache holds.)
export EXLA_RS_CUDA_NVCC=${EXLA_RS_CUDA_NVCC:-0}
export EXLA_RS_GPUSIM_MAX_SEQ=${EXLA_RS_GPUSIM_MAX_SEQ:-160}
JOBS=${EXLA_RS_GPUSIM_JOBS:-2}
# A sanitizer report ends the harness at once with these exit codes.
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
export ASAN_OPTIONS="detect_leaks=0 halt_on_error=1 exitcode=67 ${ASAN_OPTIONS:-}"

# ---------------------------------------------------------------------------------------------
# Steps: each runs its command(s) with output to $LOGS/<step>.log.

cargo_gpusim() { # cargo_gpusim TARGET_SUBDIR ARGS...: cargo in its own target dir, profile gpusim
  local dir=$1; shift
  cargo "$@" --profile gpusim --manifest-path "$CARGO_MANIFEST" --target-dir "$TARGET/$dir"
}

step_build() {
  cargo_gpusim gpu_on_cpu build -p exla-rs-xla --features gpu-on-cpu || return 1
  # The executor must be in this library and only there.
  nm -D --defined-only "$LIB" | grep -q exla_rs_flash_attn_fwd_cuda_on_cpu || { echo "$LIB lacks the cuda_on_cpu handlers"; return 1; }
}

step_rust() {
  cargo_gpusim gpu_on_cpu test -p exla-rs-gpusim -p exla-rs-xla --features exla-rs-xla/gpu-on-cpu
}

pytest_gpu() { # pytest_gpu [ENV=VALUE ...] [PYTEST ARGS ...]: test/gpu on the gpu-on-cpu library
  local envs=()
  while (($#)) && [[ $1 == *=* && $1 != -* ]]; do envs+=("$1"); shift; done
  env EXLA_RS_TEST_PLATFORM=cuda-on-cpu EXLA_RS_XLA_LIB="$LIB" "${envs[@]}" \
    "$PY" -m pytest -q -p no:cacheprovider -o console_output_style=count test/gpu/test_cuda_xla.py "$@"
}
sum_counts() { # sum_counts LOG...: the runs' summary lines (pytest's, the harness's) added up, last
  cat "$@" | awk '/^=* *[0-9]+ (passed|failed|error)/ || /^[0-9]+ (passed|failed)(,| in )/ {
      for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^(failed|errors?)/) f += $i } }
    END { print "(shards and coverage)"; print p + 0 " passed, " f + 0 " failed" }'
}
run_shards() { # run_shards DIR FN: FN I for I < $JOBS side by side, output to DIR/I.log; then every log
  local dir=$1 fn=$2 i rc=0 pids=()
  for ((i = 0; i < JOBS; i++)); do
    "$fn" "$i" >"$dir/$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || rc=1; echo "--- shard $i/$JOBS"; cat "$dir/$i.log"; done
  return $rc
}
sharded_tests() { # sharded_tests PATH: test/gpu with EXLA_RS_CUDA_PATH=PATH
  # The longest steps: $JOBS shards side by side (conftest.py's EXLA_RS_TEST_SHARD), then the
  # coverage test on the union of the kernels they launched; the last line sums the runs. The sm90
  # run holds 294 tests since the sm90 backward's feature sets and D = 256 (issue 32).
  local path=$1 dir=$LOGS/tests-$1.shards rc=0
  rm -rf "$dir" && mkdir -p "$dir"
  one_shard() { pytest_gpu EXLA_RS_CUDA_PATH="$path" EXLA_RS_TEST_SHARD="$1/$JOBS" EXLA_RS_TEST_LAUNCHES_DIR="$dir"; }
  run_shards "$dir" one_shard || rc=1
  pytest_gpu EXLA_RS_CUDA_PATH="$path" EXLA_RS_TEST_LAUNCHES_DIR="$dir" -k test_every_kernel_was_launched >"$dir/coverage.log" 2>&1 || rc=1
  echo "--- coverage"; cat "$dir/coverage.log"
  sum_counts "$dir"/*.log
  return $rc
}
step_tests_mma() { sharded_tests mma; }
step_tests_sm90() { sharded_tests sm90; }

HARNESS=$TARGET/gpu_on_cpu/gpusim/examples/gpu_on_cpu_check
harness() { # harness SANITIZER: the harness built and run under the sanitizer, in $JOBS shards
  # Same target dir as the library: the executor keeps one object set per sanitizer mode, so only
  # what links it is rebuilt here.
  EXLA_RS_GPUSIM_SANITIZE=$1 cargo_gpusim gpu_on_cpu build -p exla-rs-gpusim --example gpu_on_cpu_check || return 1
  local dir=$LOGS/harness-$1 rc=0
  rm -rf "$dir" && mkdir -p "$dir"
  harness_shard() { "$HARNESS" --shard "$1/$JOBS" --launches "$dir/launches-$1"; }
  run_shards "$dir" harness_shard || { echo "$JOBS shards: at least one failed"; return 1; }
  # Every kernel image, over the shards together.
  "$HARNESS" --coverage "$dir"/launches-* | tee "$dir/coverage.log" || rc=1
  sum_counts "$dir"/*.log
  return $rc
}
step_tsan() { harness thread; }
step_asan() {
  harness address || return 1
  # The proof that every buffer is bounded exactly: one output allocated an element short must
  # end the run in AddressSanitizer's report.
  local log=$LOGS/asan-short-o.log
  if "$HARNESS" --only f16_d64_tall_fwd --short-o >"$log" 2>&1; then
    echo "FAIL: an output one element short ran clean under AddressSanitizer"; cat "$log"; return 1
  fi
  grep -q "AddressSanitizer: heap-buffer-overflow" "$log" || { echo "FAIL: no heap-buffer-overflow report"; cat "$log"; return 1; }
  echo "ok: AddressSanitizer reports the store past an output one element short"
}
step_mutations() { python3 scripts/gpu_on_cpu_mutations.py; }
step_stats() {
  EXLA_RS_GPUSIM_SANITIZE=stats cargo_gpusim gpu_on_cpu_stats build -p exla-rs-xla --features gpu-on-cpu || return 1
  EXLA_RS_XLA_LIB=$TARGET/gpu_on_cpu_stats/gpusim/libexla_rs_xla.so "$PY" bench/bank_conflicts.py --markdown || return 1
  # Global bytes of decode calls: the split-KV path reads K/V once (issue 34, bench/RESULTS.md).
  EXLA_RS_XLA_LIB=$TARGET/gpu_on_cpu_stats/gpusim/libexla_rs_xla.so "$PY" bench/decode_traffic.py --markdown || return 1
  # Global bytes of the f16/bf16 backward per kernel against the FA2 schedule (issue 33 part 2).
  EXLA_RS_XLA_LIB=$TARGET/gpu_on_cpu_stats/gpusim/libexla_rs_xla.so "$PY" bench/bwd_traffic.py --markdown --check
}

# ---------------------------------------------------------------------------------------------
# Bookkeeping: per-step time, counts and outcome.

DEFAULT_STEPS=(build rust tests-mma tests-sm90 tsan asan)
ALL_STEPS=("${DEFAULT_STEPS[@]}" mutations stats)
summary=()
total_passed=0 total_failed=0

counts() { # counts LOG: "PASSED FAILED" from pytest's, cargo test's or the harness's summary lines
  awk '
    /^test result: / { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) cp += $i; if ($(i+1) ~ /^failed/) cf += $i }; cargo = 1 }
    /^=* *[0-9]+ (passed|failed|error)/ || /^[0-9]+ (passed|failed)(,| in )/ {
      p = 0; f = 0
      for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p = $i; if ($(i+1) ~ /^(failed|errors?)/) f += $i }
      other = 1
    }
    END { if (cargo) print cp, cf; else if (other) print p, f }' "$1"
}

run_step() { # run_step NAME: runs step_NAME, logs, times and counts it
  local name=$1 log=$LOGS/$1.log start=$SECONDS rc passed failed c
  echo "=== $name"
  "step_${name//-/_}" >"$log" 2>&1
  rc=$?
  c=$(counts "$log")
  if [[ -n $c ]]; then read -r passed failed <<<"$c"; else passed=$((rc == 0)) failed=$((rc != 0)); fi
  # A step that failed without a failed test (a build error, a crash, a sanitizer report) counts one.
  ((rc != 0 && failed == 0)) && failed=1
  total_passed=$((total_passed + passed)) total_failed=$((total_failed + failed))
  local line="$name: $((SECONDS - start)) s, $passed passed, $failed failed"
  if ((rc == 0)); then
    summary+=("PASS $line")
  else
    summary+=("FAIL $line (rc $rc, log $log)")
    # Indented, so scripts/test.sh's counting sees only this script's own summary line.
    tail -n 80 "$log" | sed 's/^/    | /'
  fi
  echo "${summary[-1]}"
}

steps=("$@")
[[ ${steps[*]:-} == --mutations ]] && steps=(mutations)
((${#steps[@]})) || steps=("${DEFAULT_STEPS[@]}")
for s in "${steps[@]}"; do
  [[ " ${ALL_STEPS[*]} " == *" $s "* ]] || { echo "unknown step $s (steps: ${ALL_STEPS[*]})"; exit 2; }
done

started=$SECONDS
for s in "${steps[@]}"; do
  run_step "$s"
done

echo
echo "=== GPU-on-CPU summary ($((SECONDS - started)) s, logs in $LOGS)"
printf '%s\n' "${summary[@]}"
echo "$total_passed passed, $total_failed failed"
((total_failed == 0))
