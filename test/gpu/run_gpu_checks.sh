#!/usr/bin/env bash
# Every GPU check in one go, sized for a 15-minute GPU window (issue 31): the whole of it in <= 8
# minutes of wall time on a 16-core H100/H200, at most 8 files back. test/gpu/README.md has more.
#
# On a GPU machine (the device tool: no Rust there, so build here and carry the library):
#   source scripts/env.sh && cargo build --release --manifest-path native/exla_rs/Cargo.toml --workspace
#   mkdir -p .gpu && cp native/exla_rs/target/release/libexla_rs_xla.so .gpu/ && echo /.gpu/ >> .git/info/exclude
#   strip .gpu/libexla_rs_xla.so   (the tree and .gpu must stay under the 64 MiB carry: see README.md)
#   optional, the NVRTC path: EXLA_RS_CUDA_NVCC=0 cargo build --release --manifest-path native/exla_rs/Cargo.toml \
#       -p exla-rs-xla --target-dir /tmp/nvrtc-target && cp /tmp/nvrtc-target/release/libexla_rs_xla.so .gpu/libexla_rs_xla_nvrtc.so
#   run(command="bash test/gpu/run_gpu_checks.sh", carry=[".gpu"], timeout_s=560)
# Back in $OUT: summary.txt (one line per step, failing/HUNG/CRASHED test ids, sanitizer errors,
# the benchmark table, last line `N passed, N failed`), tests.log, sanitize.log, bench.log, bench.md.
#
# On this machine, no GPU: the same steps against the Host handlers (GPU-only steps skipped), to see
# the plumbing work (a hung test named, its shard going on):
#   test/gpu/run_gpu_checks.sh --platform cpu --out /tmp/gpu-check [-k d64] [--test-deadline 20]
#   EXLA_RS_TEST_HANG=SUBSTRING makes the test whose id contains it hang (test/gpu/gpu_watch.py).
#
# Options (gpu_checks.py --help): --steps "env tests-mma tests-sm90 nvrtc sanitize bench",
# --jobs N, --shards N, -k SEL, --test-deadline S, --phase-deadline S, --bench-deadline S, --out DIR,
# --tools "memcheck ...", --sanitize-paths "mma sm90" (which kernel paths the sanitizers run).
set -uo pipefail
cd "$(dirname "$0")/../.."
platform=cuda
prev=""
for a in "$@"; do
  [[ $prev == --platform ]] && platform=$a
  [[ $a == --platform=* ]] && platform=${a#--platform=}
  prev=$a
done
if [[ $platform == cpu ]]; then
  # The repo's venv (scripts/setup.sh) and release build.
  source scripts/env.sh
  PY=${PY:-$EXLA_RS_VENVS/jax-0.10.2/bin/python}
else
  # The GPU image's python3 (jax with its CUDA plugin, PyTorch, pytest) and the carried library.
  PY=${PY:-python3}
  export EXLA_RS_XLA_LIB=${EXLA_RS_XLA_LIB:-$PWD/.gpu/libexla_rs_xla.so}
fi
export OUT=${OUT:-/tmp/exla_rs_gpu_out}
exec "$PY" test/gpu/gpu_checks.py --python "$PY" --out "$OUT" "$@"
