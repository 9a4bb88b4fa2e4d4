"""The GPU check's plumbing without a GPU (issue 31): run_gpu_checks.sh --platform cpu on a few
test/gpu cases against the Host handlers, with one test made to hang (gpu_watch.py's
EXLA_RS_TEST_HANG: it ignores SIGINT and SIGTERM, as a hung kernel does). The hung test must be
named in the summary with its parameters, its process group killed, and the rest of its shard
still run and reported; at most 8 files left; the summary ends with `N passed, N failed`.

    .venv/jax-0.10.2/bin/python -m pytest -q test/gpu/test_run_gpu_checks.py
"""
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELECT = "d64_ragged and (test_forward or test_backward) and not f32"
HANG = "test_forward_matches_float64_reference[d64_ragged-bf16_1]"


def test_a_hung_test_is_named_killed_and_the_shard_goes_on(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, EXLA_RS_TEST_HANG=HANG)
    env.pop("EXLA_RS_TEST_PLATFORM", None)
    t0 = time.time()
    r = subprocess.run(["bash", "test/gpu/run_gpu_checks.sh", "--platform", "cpu", "--out", str(out), "-k", SELECT, "--jobs", "2",
                        "--shards", "1", "--test-deadline", "15", "--phase-deadline", "400", "--steps", "env tests-mma tests-sm90 sanitize bench"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall = time.time() - t0
    summary = (out / "summary.txt").read_text()
    assert r.returncode == 1, f"a hung test must fail the run (exit {r.returncode})\n{summary}\n{r.stderr[-2000:]}"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    lines = summary.strip().splitlines()
    # One hung test, named with its path and its case's shape; the shard restarted without it.
    hung = [ln for ln in lines if ln.startswith("HUNG: ")]
    assert len(hung) == 1 and HANG in hung[0], summary
    assert "EXLA_RS_CUDA_PATH=mma" in hung[0] and "d=64" in hung[0] and "no return after 15 s" in hung[0], hung[0]
    # 8 tests selected (forward and backward, f16 and bf16, causal or not): 7 passed, 1 hung.
    step = next(ln for ln in lines if ln.startswith("tests-mma"))
    assert re.search(r"\b7 passed\b", step) and re.search(r"\b1 hung\b", step), step
    assert "failed" not in step.split(";")[0], step
    assert any(ln.startswith("tests-sm90") and "skipped (GPU-only" in ln for ln in lines), summary
    assert any(ln.startswith("sanitize") and "skipped (GPU-only)" in ln for ln in lines), summary
    assert any(ln.startswith("bench") and "ok" in ln for ln in lines), summary
    assert lines[-1] == "8 passed, 1 failed", lines[-1]
    # The restart: the shard's log has two runs, the first killed in the hung test.
    log = (out / "tests.log").read_text()
    assert f"HUNG in test/gpu/test_cuda_xla.py::{HANG}" in log and "(run 2)" in log, log[-3000:]
    # The hung child is gone (its process group was killed).
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "-p gpu_watch" not in ps, ps
    assert wall < 300, wall


SANITIZER_LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at exla_rs_fwd_bf16_d64+0x1a70 in flash_fwd.cuh:412
=========     by thread (3,0,0) in block (7,1,0)
=========     Address 0x7f00001000 is out of bounds
=========
========= Program hit cudaErrorNotReady (error 600) due to "device not ready" on CUDA API call to cudaEventQuery.
=========     Saved host backtrace up to driver entry point at error
=========
========= Error: Race reported between Write access at exla_rs_bwd_f16_d128+0x30 in flash_bwd.cuh:88
=========     and Read access at exla_rs_bwd_f16_d128+0x90 in flash_bwd.cuh:95 [64 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
========= ERROR SUMMARY: 3 errors
"""


def test_sanitizer_errors_are_split_into_ours_and_the_rest():
    import gpu_checks

    errors, total = gpu_checks.sanitizer_errors(SANITIZER_LOG)
    assert total == 3
    ours = [e for e in errors if gpu_checks.in_our_kernels(e)]
    assert [e[0][:22] for e in ours] == ["Invalid __global__ wri", "Error: Race reported b"], errors
    assert ours[0][1].startswith("exla_rs_fwd_bf16_d64+0x1a70"), ours
    assert len(errors) == 3 and errors[1][0].startswith("Program hit cudaErrorNotReady"), errors
