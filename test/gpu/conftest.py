import os
import sys
from pathlib import Path

# Reuse the Host tests' helper (registration, ffi_call wrappers, float64 forward reference) and cases.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "xla"))
sys.path.insert(0, str(Path(__file__).parent))
# Each output buffer its own cudaMalloc (no pool), so compute-sanitizer sees exact bounds and a
# freed NaN-filled buffer is handed straight back to the next call (see poison()).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)


def pytest_report_header(config):
    import exla_rs_jax

    try:
        devs = jax.devices("gpu")
    except RuntimeError as e:
        devs = f"none ({e})"
    return [f"jax {jax.__version__}, GPU devices {devs}, library {exla_rs_jax.lib_path()}"]
