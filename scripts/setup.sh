#!/usr/bin/env bash
# Installs everything the tests and the demo need on a fresh Debian 12 machine, offline from hex/GitHub:
# Debian's Erlang/OTP 25 (Elixir >= 1.17 comes from the offline toolchain beside the checkout, see
# scripts/elixir.sh), two jax[cpu] venvs (FFI 0.2 and 0.3), NVIDIA's pip nvcc, a PJRT CPU plugin,
# Hugging Face's tokenizers (the Bumblebee test's tokenizer.json).
# Idempotent: each step is skipped when its result is already there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venvs=$root/.venv
mkdir -p "$venvs"

need_apt=()
dpkg -s erlang-dev >/dev/null 2>&1 || need_apt+=(erlang-dev)
dpkg -s erlang-nox >/dev/null 2>&1 || need_apt+=(erlang-nox)
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
python3 -c 'import ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
if ((${#need_apt[@]})); then
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# Rust is the one tool this script does not install (Debian 12's cargo is too old for the crates).
if ! command -v cargo >/dev/null 2>&1 && [[ ! -x $HOME/.cargo/bin/cargo ]]; then
  echo "setup: cargo not found: install Rust >= 1.80 (rustup) and put cargo on PATH" >&2
  exit 1
fi

# venv NAME PIP-ARGS...: a Python venv under .venv/NAME with the given packages, made once.
venv() {
  local name=$1; shift
  local dir=$venvs/$name stamp=$venvs/$name/.exla_rs_ok
  local want="$*"
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then return; fi
  echo "setup: venv $name: $want"
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q --disable-pip-version-check "$@"
  echo "$want" >"$stamp"
}

venv jax-0.9.0  "jax[cpu]==0.9.0"  "numpy<3" pytest==8.3.5 ml_dtypes
venv jax-0.10.2 "jax[cpu]==0.10.2" "numpy<3" pytest==8.3.5 ml_dtypes
# nvcc + cccl: compile every CUDA kernel in CI, with no GPU present. nvvm/crt/runtime are pinned to
# 13.0 too: unpinned, pip picks 13.5's cicc, whose PTX 9.5 the 13.0 ptxas (and driver 580) refuse.
# cuobjdump + nvdisasm read the built kernels' SASS (kernels/sass_stats.py, the CI spill check); no
# 13.0.x wheel of them exists on PyPI, 13.2.51 is the oldest and disassembles 13.0's sm_80..sm_90 code.
venv cuda "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-cuobjdump==13.2.51" "nvidia-cuda-nvdisasm==13.2.51"
# A real XLA CPU PJRT plugin (exports GetPjrtApi, FFI extension) for the NIF registration test.
venv pjrt "lammps-jax-pjrt-cpu==0.11.2"
# Hugging Face's tokenizers: scripts/make_test_tokenizer.py makes (and CI checks) the small real
# tokenizer.json of the Bumblebee serving test (test/data/bumblebee_tokenizer).
venv tokenizers "tokenizers==0.21.1"
# Benchmarks only, never the tests (`scripts/setup.sh --bench`): PyTorch's CPU SDPA next to our
# handlers in one process (bench/bench_host.py --torch).
if [[ ${1:-} == --bench ]]; then
  venv bench "jax[cpu]==0.10.2" "numpy<3" ml_dtypes torch==2.15.0
fi
echo "setup: done"
