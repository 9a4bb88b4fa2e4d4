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


# cuda-on-cpu: test_every_kernel_was_launched judges the launches of the whole file, so it runs
# last and only when no test was deselected (-k) before it.
DESELECTED = []

# EXLA_RS_TEST_SHARD=I/N keeps every N-th test from the I-th (0-based): N processes run the file
# side by side on the CPU-executed kernels. Each shard writes the kernels it launched to
# EXLA_RS_TEST_LAUNCHES_DIR/shard-I.json; the coverage test runs afterwards on its own with
# EXLA_RS_TEST_LAUNCHES_DIR set and judges the union (scripts/gpu_on_cpu.sh does both).
SHARD = os.environ.get("EXLA_RS_TEST_SHARD", "")
LAUNCHES_DIR = os.environ.get("EXLA_RS_TEST_LAUNCHES_DIR", "")


def shard_of():
    if not SHARD:
        return None
    try:
        i, n = (int(x) for x in SHARD.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise SystemExit(f"EXLA_RS_TEST_SHARD={SHARD!r}: expected I/N with 0 <= I < N")
    return i, n


def pytest_deselected(items):
    DESELECTED.extend(items)


def pytest_collection_modifyitems(session, config, items):
    last = [i for i in items if i.name == "test_every_kernel_was_launched"]
    rest = [i for i in items if i not in last]
    shard = shard_of()
    if shard is not None:
        # Not DESELECTED: the other shards run them. The coverage test runs after all shards.
        i, n = shard
        rest, last = rest[i::n], []
    items[:] = rest + last


def pytest_sessionstart(session):
    if os.environ.get("EXLA_RS_TEST_PLATFORM") == "cuda-on-cpu":
        import exla_rs_jax

        exla_rs_jax.gpusim_stats_reset()


def pytest_sessionfinish(session, exitstatus):
    shard = shard_of()
    if shard is not None and LAUNCHES_DIR and os.environ.get("EXLA_RS_TEST_PLATFORM") == "cuda-on-cpu":
        import json

        import exla_rs_jax

        Path(LAUNCHES_DIR, f"shard-{shard[0]}.json").write_text(json.dumps(exla_rs_jax.gpusim_launch_counts()))
    # The executor's shared-memory bank statistics of the run, for bench/RESULTS.md (issue 22).
    out = os.environ.get("EXLA_RS_GPUSIM_STATS_OUT")
    if out and os.environ.get("EXLA_RS_TEST_PLATFORM") == "cuda-on-cpu":
        import json

        import exla_rs_jax

        Path(out).write_text(json.dumps({"launches": exla_rs_jax.gpusim_launch_counts(), "banks": exla_rs_jax.gpusim_bank_stats()}, indent=1))
