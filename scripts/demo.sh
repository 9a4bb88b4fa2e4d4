#!/usr/bin/env bash
# The main job: build the handler library and run flash attention through a real XLA (jax[cpu]),
# printing the check against a float64 reference and the times next to XLA's own attention.
# Extra arguments go to scripts/demo.py (e.g. --seq 4096 --no-causal).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh
cargo build --release --manifest-path "$CARGO_MANIFEST" -p exla-rs-xla
exec "$EXLA_RS_VENVS/jax-0.10.2/bin/python" scripts/demo.py "$@"
