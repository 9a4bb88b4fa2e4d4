#!/usr/bin/env bash
# Runs every test: Rust unit tests, the C-header layout check, the handlers through two real XLAs
# (jax 0.9.0 = FFI 0.2, jax 0.10.2 = FFI 0.3), and ExUnit on real Nx. `.ci/run` calls this.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
source scripts/env.sh

results=()
total_passed=0 total_failed=0
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# count_tests LOG: "PASSED FAILED" from the closing lines of the runner that wrote LOG (cargo
# test's `test result:` lines summed, pytest's last summary, ExUnit's `N tests, N failures`), or
# nothing for a step that runs no test runner.
count_tests() {
  awk '
    /^test result: / { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i }; seen = 1 }
    /^=* *[0-9]+ (passed|failed|error)/ || /^[0-9]+ (passed|failed)(,| in )/ {
      pp = 0; ff = 0
      for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) pp = $i; if ($(i+1) ~ /^(failed|errors?)/) ff += $i }
      py_p = pp; py_f = ff; py = 1
    }
    /^[0-9]+ tests?, [0-9]+ failures?/ {
      ex_t = $1; ex_f = $3; ex_x = 0
      for (i = 4; i <= NF; i++) if ($(i+1) ~ /^(excluded|skipped|invalid)/) ex_x += $i
      ex = 1
    }
    END {
      if (seen) print p, f
      else if (py) print py_p, py_f
      else if (ex) print ex_t - ex_f - ex_x, ex_f
    }' "$1"
}
record() { # record NAME RC LOG START: the step's outcome, test counts and wall time in the summary
  local name=$1 rc=$2 log=$3 start=$4 counts passed failed
  counts=$(count_tests "$log")
  if [[ -n $counts ]]; then
    read -r passed failed <<<"$counts"
    # A runner that failed without counting a failed test (a crash, a build error) is one failure.
    ((rc != 0 && failed == 0)) && failed=1
    counts=" ($passed passed, $failed failed)"
  else
    # A step with no test runner (a build, the demo) counts as one check.
    if ((rc == 0)); then passed=1 failed=0; else passed=0 failed=1; fi
  fi
  total_passed=$((total_passed + passed)) total_failed=$((total_failed + failed))
  # Each step's wall time in the summary: CI's budget is watched from it.
  counts+=" [$((SECONDS - start)) s]"
  if ((rc == 0)); then results+=("PASS $name$counts"); else results+=("FAIL $name$counts"); fi
}
step() { # step NAME CMD...: runs one suite, records its outcome and test counts, keeps going.
  local name=$1; shift
  echo; echo "=== $name"
  local log=$logs/${#results[@]}.log start=$SECONDS
  "$@" 2>&1 | tee "$log"
  record "$name" "${PIPESTATUS[0]}" "$log" "$start"
}
# Independent steps that each keep about one core busy run side by side on CI's two cores:
# step_bg starts one (output to its log), steps_wait waits for them in order, prints each log
# whole and records it as step does (a step's time then runs to when it was waited for).
bg_names=() bg_pids=() bg_logs=() bg_starts=()
step_bg() { # step_bg NAME CMD...
  local name=$1; shift
  local log=$logs/bg${#bg_names[@]}-${#results[@]}.log
  "$@" >"$log" 2>&1 &
  bg_pids+=($!) bg_names+=("$name") bg_logs+=("$log") bg_starts+=("$SECONDS")
}
steps_wait() {
  local i rc
  for i in "${!bg_pids[@]}"; do
    wait "${bg_pids[$i]}"
    rc=$?
    echo; echo "=== ${bg_names[$i]}"
    cat "${bg_logs[$i]}"
    record "${bg_names[$i]}" "$rc" "${bg_logs[$i]}" "${bg_starts[$i]}"
  done
  bg_names=() bg_pids=() bg_logs=() bg_starts=()
}

# One value for every cargo build of this run: exla-rs-cuda's build script keys on it, and the
# builds that share a target dir (cargo test and scripts/gpu_on_cpu.sh) must share exla-rs-cuda.
# On: the kernels' fatbins, nvcc's work done once by the release build, then from its cache.
export EXLA_RS_CUDA_NVCC=on
# The GPU-on-CPU executor (exla-rs-gpusim) never enters the release build. The NIF crate does,
# though scripts/release.sh builds it again per NIF version: left out here, its dependencies were
# compiled a second time for the release's first NIF (205 s instead of 81 s, 2026-11-27).
step "cargo build (release)" cargo build --release --manifest-path "$CARGO_MANIFEST" --workspace --exclude exla-rs-gpusim
# Every crate's tests (the executor crate's and the gpu-on-cpu handlers' included), optimised like
# the release without its LTO (Cargo.toml's gpusim profile), in the target dir where
# scripts/gpu_on_cpu.sh then builds its handler library and harness: one compile of the workspace
# serves both (its `rust` step is this one).
step "cargo test" cargo test --profile gpusim --target-dir "$EXLA_RS_ROOT/native/exla_rs/target/gpu_on_cpu" --no-fail-fast \
  --manifest-path "$CARGO_MANIFEST" --workspace --exclude exla_rs_nif --features exla-rs-xla/gpu-on-cpu
# The two XLAs side by side (each process runs its tests one at a time).
for v in jax-0.9.0 jax-0.10.2; do
  step_bg "pytest test/xla ($v)" "$EXLA_RS_VENVS/$v/bin/python" -m pytest -q -p no:cacheprovider test/xla
done
steps_wait
# The GPU check's plumbing (test/gpu/run_gpu_checks.sh --platform cpu against the Host handlers):
# a test made to hang is named, its process group killed, its shard goes on, <= 8 files (#31).
step "GPU check script on the CPU (a hung test named)" "$EXLA_RS_VENVS/jax-0.10.2/bin/python" -m pytest -q -p no:cacheprovider test/gpu/test_run_gpu_checks.py
# No kernel may spill: any LDL/STL in the SASS of the release build's fatbins fails CI, beyond the
# measured exceptions in sass_stats.py's KNOWN_SPILLS (per-kernel instruction/HMMA/integer-op
# counts are printed too: the signal for kernel work without a GPU). And the plain feature set
# (what most calls run) within its SASS budget: instructions and integer ops per HMMA per kernel,
# so no optional feature and no change taxes the common path unnoticed (#26). One cuobjdump pass.
# --check-regpool: every setmaxnreg kernel's producer/consumer split fits its launch register pool
# (REG x threads from the cubin); one that does not hangs every launch (#32, D = 256 on an H200).
# --check-loop: the plain sets' key loops (the loop holding the most HMMA) within their
# instructions and integer ops per HMMA (#33); --loop prints their mix. --smem / --check-smem: each
# kernel's shared memory (static + what its launch asks for, from exla-rs-cuda's launch_table
# example, built by the cargo test step) and blocks per SM on the A100, RTX 30xx/40xx/L4 and H100;
# an image over its GPUs' per-block limit, a built kernel no launch names, or a launched one no
# fatbin holds fails (#33 part 3).
step "CUDA kernels: SASS statistics, no spills, plain set and key loops within budget" "$EXLA_RS_VENVS/jax-0.10.2/bin/python" native/exla_rs/kernels/sass_stats.py --loop --check-spills --check --check-loop --check-regpool \
  --smem --check-smem --launches "$EXLA_RS_ROOT/native/exla_rs/target/gpu_on_cpu/gpusim/examples/launch_table"
# The CUDA kernels themselves, executed on the CPU with the GPU's semantics (issue 22): test/gpu
# through real XLA for the mma.sync and the sm90 kernel sets, and the harness that launches every
# kernel image under ThreadSanitizer and AddressSanitizer (the script prints each part's time).
# The executor's own checks first: its PTX models against independent references, its
# collective/deadlock/timing checks, the planted race and out-of-bounds store the sanitizers must
# catch, the kernels' mask intervals (common.cuh) against the contract's predicate, and the sm90
# instruction models from first principles. (With test/gpu these took over every check of the
# retired Python emulators: native/exla_rs/kernels/README.md maps each one.)
step_bg "GPU-on-CPU executor tests" native/exla_rs/crates/exla-rs-gpusim/executor/tests/run_executor_test.sh
step_bg "GPU-on-CPU sm90 instruction models" native/exla_rs/crates/exla-rs-gpusim/executor/tests/run_sm90_models_test.sh
steps_wait
step "CUDA kernels on the CPU (scripts/gpu_on_cpu.sh)" ./scripts/gpu_on_cpu.sh build tests-mma tests-sm90 tsan asan
# The README's main job, small: it must run to its check and its timings.
step "demo (scripts/demo.py, S=256)" "$EXLA_RS_VENVS/jax-0.10.2/bin/python" scripts/demo.py --seq 256 --repeats 1
# The Bumblebee serving test's tokenizer.json is what scripts/make_test_tokenizer.py makes.
step "test tokenizer.json up to date" "$EXLA_RS_VENVS/tokenizers/bin/python" scripts/make_test_tokenizer.py --check
# ExUnit on Elixir >= 1.17 with real Nx, EXLA's Elixir side and Axon as Mix dependencies
# (scripts/elixir.sh), the user-project test included: nothing is excluded.
# The release as Hex users get it: one NIF per NIF version (2.15, 2.16, 2.17) with every CUDA kernel
# inside, their checksum file and the Hex package. mix test's precompiled test installs it into a
# user project with no Rust on PATH, served from 127.0.0.1 (test/exla_rs/precompiled_test.exs).
export EXLA_RS_RELEASE_DIR=$logs/release
step "release (scripts/release.sh)" ./scripts/release.sh --out "$EXLA_RS_RELEASE_DIR"
source scripts/elixir.sh
mix_test() {
  exla_rs_elixir || return 1
  if [[ $EXLA_RS_ELIXIR_FROM == path ]]; then MIX_ENV=test mix deps.get || return 1; fi
  MIX_ENV=test mix test
}
step "mix test" mix_test
# The hexdocs: the plots must match bench/RESULTS.md, and ExDoc must build every page without a warning.
step "docs: plots match bench/RESULTS.md" "$EXLA_RS_VENVS/jax-0.10.2/bin/python" scripts/plots.py --check
docs() { exla_rs_elixir && MIX_ENV=test mix docs --warnings-as-errors; }
step "docs (mix docs)" docs

echo; echo "=== summary"
failed_steps=0
for r in "${results[@]}"; do echo "$r"; [[ $r == FAIL* ]] && failed_steps=$((failed_steps + 1)); done
# Tests across every suite (a step without a runner counts as one).
echo "wall time: $SECONDS s"
# Which machine: CI's budget differs by CPU (a Zen 1 EPYC is the slower one it names).
awk -F': ' '/^model name/ && !m { m = $2 } /^cpu family/ && !f { f = $2 } /^model\t/ && !o { o = $2 }
  /^flags/ && !x { n = split($2, a, " "); for (i = 1; i <= n; i++) if (a[i] ~ /^(avx2|avx512f|avx512_bf16|amx_tile)$/) x = x " " a[i] }
  END { printf "machine: %s (family %s model %s), %d cores,%s\n", m, f, o, '"$(nproc)"', x }' /proc/cpuinfo
echo "$total_passed passed, $total_failed failed"
((failed_steps == 0))
