#!/usr/bin/env bash
# Every CUDA check that needs a GPU, in one go, for a session lent an H100/H200 (device tool).
# The machine has jax[cuda13], torch, compute-sanitizer but no Rust: build here first, then carry
# the libraries:
#   cargo build --release --manifest-path native/exla_rs/Cargo.toml --workspace   (nvcc kernels)
#   mkdir -p .gpu && cp native/exla_rs/target/release/libexla_rs_xla.so .gpu/libexla_rs_xla.so
#   EXLA_RS_CUDA_NVCC=0 cargo build --release --manifest-path native/exla_rs/Cargo.toml -p exla-rs-xla \
#       --target-dir /tmp/nvrtc-target && cp /tmp/nvrtc-target/release/libexla_rs_xla.so .gpu/libexla_rs_xla_nvrtc.so
#   echo /.gpu/ >> .git/info/exclude
# then: run(command="bash test/gpu/run_gpu_checks.sh", carry=[".gpu"]). Logs land in $OUT.
# Steps: STEPS="env tests sm90 nvrtc sanitize bench" (default all) selects some. The default forward
# is the mma.sync set (auto does not pick the sm90 forward until it has passed here: issue 22), so
# `tests` checks mma.sync; `sm90` reruns the tests with EXLA_RS_CUDA_PATH=sm90 (the wgmma/TMA
# forward for f16/bf16 at D = 64/128/256 without optional operands on an H100/H200), and
# `sanitize` runs each tool on both paths. All green on Hopper: record it in bench/RESULTS.md and
# flip AUTO_PICKS_SM90 (crates/exla-rs-cuda/src/sm90.rs).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/exla_rs_gpu_out}; mkdir -p "$OUT"
STEPS=${STEPS:-env tests sm90 nvrtc sanitize bench}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export EXLA_RS_XLA_LIB=${EXLA_RS_XLA_LIB:-$PWD/.gpu/libexla_rs_xla.so}
PY=${PY:-python3}
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0

if has env; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
  $PY -c 'import jax, numpy; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$OUT/env.txt"
  ls -la "$EXLA_RS_XLA_LIB" | tee -a "$OUT/env.txt"
fi

if has tests; then
  # Every case and dtype; fresh seed each run (printed in failures; EXLA_RS_SEED replays).
  timeout 540 $PY -m pytest -q -x -p no:cacheprovider test/gpu/test_cuda_xla.py 2>&1 | tee "$OUT/tests.log" || status=1
fi

if has sm90; then
  # The same suite with the sm90 forward opted in (src/sm90.rs): it runs wherever it applies.
  EXLA_RS_CUDA_PATH=sm90 timeout 540 $PY -m pytest -q -x -p no:cacheprovider test/gpu/test_cuda_xla.py 2>&1 | tee "$OUT/tests_sm90.log" || status=1
fi

if has nvrtc; then
  # The run-time compile path: a library built without nvcc compiles the kernels with NVRTC at
  # first use (the pip nvidia-cuda-nvrtc in the image provides libnvrtc).
  nvrtc=""
  for c in ${CUDA_HOME:-/usr/local/cuda}/lib64/libnvrtc.so.13 /usr/local/cuda/lib64/libnvrtc.so.13 \
      $($PY -c 'import glob, site; print(" ".join(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib/libnvrtc.so.1*")))' 2>/dev/null); do
    [[ -f $c ]] && { nvrtc=$c; break; }
  done
  echo "NVRTC: ${nvrtc:-none found}" | tee "$OUT/nvrtc.log"
  EXLA_RS_NVRTC=$nvrtc EXLA_RS_XLA_LIB=$PWD/.gpu/libexla_rs_xla_nvrtc.so timeout 300 $PY -m pytest -q -x -p no:cacheprovider \
    test/gpu/test_cuda_xla.py -k "ragged and (bf16 or f32)" 2>&1 | tee -a "$OUT/nvrtc.log" || status=1
fi

if has sanitize; then
  # Out-of-bounds accesses, shared-memory races, barrier misuse and reads of uninitialised memory
  # in our kernels only (XLA's and cuDNN's kernels are not instrumented). No pool allocator, so
  # every XLA buffer is its own allocation and memcheck sees its exact bounds.
  export XLA_PYTHON_CLIENT_ALLOCATOR=platform
  sel="(d64_ragged or d128_ragged or d192_ragged or d256_ragged or everything) and not f32"
  for path in mma sm90; do
    for tool in memcheck racecheck synccheck initcheck; do
      EXLA_RS_CUDA_PATH=$path timeout 540 compute-sanitizer --tool $tool --kernel-name kns=exla_rs --error-exitcode 99 \
        $PY -m pytest -q -x -p no:cacheprovider test/gpu/test_cuda_xla.py -k "$sel" 2>&1 | tee "$OUT/sanitize_${tool}_$path.log" || status=1
    done
  done
  unset XLA_PYTHON_CLIENT_ALLOCATOR
fi

if has bench; then
  timeout 590 $PY bench/bench_cuda.py --results "$OUT/results_cuda.md" 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit $status
