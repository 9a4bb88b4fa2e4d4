# Sourced by the scripts: paths to the tools scripts/setup.sh installed inside the repo.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export EXLA_RS_ROOT=$root
export EXLA_RS_VENVS=$root/.venv
export CARGO_MANIFEST=$root/native/exla_rs/Cargo.toml
export EXLA_RS_XLA_LIB=$root/native/exla_rs/target/release/libexla_rs_xla.so
# Kernel fatbins by content (exla-rs-cuda's build.rs): each profile and feature set of the
# workspace (the release build, the tests, the release's NIFs) compiles a kernel with nvcc once.
export EXLA_RS_CUDA_CACHE=${EXLA_RS_CUDA_CACHE:-$root/native/exla_rs/target/cuda-cache}
# NVIDIA's pip nvcc, when setup installed it and no CUDA_HOME was given: build.rs compiles the kernels.
if [[ -z ${CUDA_HOME:-} ]]; then
  for d in "$EXLA_RS_VENVS"/cuda/lib/python3*/site-packages/nvidia/cu13; do
    [[ -x $d/bin/nvcc ]] && export CUDA_HOME=$d
  done
fi
# The PJRT CPU plugin the NIF registration test loads.
if [[ -z ${EXLA_RS_PJRT_PLUGIN:-} ]]; then
  for f in "$EXLA_RS_VENVS"/pjrt/lib/python3*/site-packages/*/pjrt_c_api_cpu_plugin.so; do
    [[ -f $f ]] && export EXLA_RS_PJRT_PLUGIN=$f
  done
fi
