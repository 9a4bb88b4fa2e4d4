#!/usr/bin/env bash
# Runs every test: Rust unit tests, the C-header layout check, the handlers through two real XLAs
# (jax 0.9.0 = FFI 0.2, jax 0.10.2 = FFI 0.3), and ExUnit on real Nx. `.ci/run` calls this.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
source scripts/env.sh

results=()
step() { # step NAME CMD...: runs one suite, records its outcome, keeps going.
  local name=$1; shift
  echo; echo "=== $name"
  if "$@"; then results+=("PASS $name"); else results+=("FAIL $name"); fi
}

step "cargo build (release)" cargo build --release --manifest-path "$CARGO_MANIFEST" --workspace
step "cargo test" cargo test --release --no-fail-fast --manifest-path "$CARGO_MANIFEST" --workspace --exclude exla-rs-nif
for v in jax-0.9.0 jax-0.10.2; do
  step "pytest test/xla ($v)" "$EXLA_RS_VENVS/$v/bin/python" -m pytest -q -p no:cacheprovider test/xla
done
# The tensor-core kernels' fragment and address math, emulated lane by lane on the CPU against
# float64 (the real kernels need a GPU; test/gpu runs them there).
step "CUDA kernel emulation" "$EXLA_RS_VENVS/jax-0.10.2/bin/python" native/exla_rs/kernels/emulate.py
# The README's main job, small: it must run to its check and its timings.
step "demo (scripts/demo.py, S=256)" "$EXLA_RS_VENVS/jax-0.10.2/bin/python" scripts/demo.py --seq 256 --repeats 1
# ExUnit on Elixir >= 1.17 with real Nx, EXLA's Elixir side and Axon as Mix dependencies
# (scripts/elixir.sh), the user-project test included: nothing is excluded.
source scripts/elixir.sh
mix_test() {
  exla_rs_elixir || return 1
  if [[ $EXLA_RS_ELIXIR_FROM == path ]]; then MIX_ENV=test mix deps.get || return 1; fi
  MIX_ENV=test mix test
}
step "mix test" mix_test

echo; echo "=== summary"
failed=0
for r in "${results[@]}"; do echo "$r"; [[ $r == FAIL* ]] && failed=$((failed + 1)); done
echo "$(( ${#results[@]} - failed )) passed, $failed failed"
((failed == 0))
