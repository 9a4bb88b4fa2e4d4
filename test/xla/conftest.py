import os
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
# The jax.grad reference runs in float64.
jax.config.update("jax_enable_x64", True)


def pytest_report_header(config):
    import exla_rs_jax

    return [f"jax {jax.__version__}, jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}, library {exla_rs_jax.lib_path()}"]
