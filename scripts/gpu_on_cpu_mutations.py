#!/usr/bin/env python3
"""Proof that the GPU-on-CPU executor catches what it must (issue 22, part 6).

Each mutation below breaks one kernel the way a real kernel bug would (a barrier removed, a wait
removed, an index off by a row, two blocks' output rows overlapping, a TMA box off by a tile, a wgmma wait moved before the last use of
its accumulators, a wrong mbarrier parity). In one scratch copy of native/exla_rs, for the
unmodified tree and then for each mutation applied alone, the sanitizer harness
(crates/exla-rs-gpusim/examples/gpu_on_cpu_check) is built with the executor under ThreadSanitizer
and run on the cases that launch the mutated kernel. The unmodified tree must pass; every mutation
must fail, and the report must come from the check named in its row: ThreadSanitizer's race
report, the executor's initcheck (an operand read from never-written shared memory), its deadlock
report, or the comparison with the Host kernels. Exit status 0 only if all of that holds.

    scripts/gpu_on_cpu_mutations.py [--keep DIR] [--only NAME]   (scripts/gpu_on_cpu.sh --mutations)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RACE = "ThreadSanitizer: data race"
INITCHECK = "initcheck:"
DEADLOCK = "deadlock in block"
MISMATCH = "FAIL "  # the harness's line for a case that disagrees with the Host kernels


@dataclass
class Mutation:
    name: str
    path: str  # under native/exla_rs/kernels
    old: str   # must occur exactly once
    new: str
    cases: str  # the harness's --only filter: cases that launch the mutated kernel
    expect: tuple[str, ...]  # the run must fail with one of these in its output
    what: str


MUTATIONS = [
    Mutation(
        "syncthreads_removed", "flash_fwd.cuh",
        "      __syncthreads();  // this stage is reloaded by the next iteration's prefetch\n", "",
        "bf16_d128_tall_fwd", (RACE,),
        "mma.sync forward (interior key loop): the barrier before the next tile's cp.async reuses the stage",
    ),
    Mutation(
        "syncthreads_removed_after_mbarrier_init", "sm90/flash_fwd_sm90.cuh",
        "    fence_barrier_init();\n  }\n  __syncthreads();\n", "    fence_barrier_init();\n  }\n",
        "sm90_bf16_d64", (RACE,),
        "sm90 forward: the barrier that publishes mbarrier.init to the other warps",
    ),
    Mutation(
        "cp_async_wait_removed", "flash_fwd.cuh",
        "      cp_async_commit();\n      cp_async_wait<1>();\n", "      cp_async_commit();\n",
        "f16_d64", (INITCHECK, RACE, MISMATCH),
        "mma.sync forward (interior key loop): the tile is read before its cp.async group has landed",
    ),
    Mutation(
        "mbarrier_wait_removed", "sm90/flash_fwd_sm90.cuh",
        "      mbar_wait(bar.k_full + stage, phase);\n", "",
        "sm90_f16_d128", (INITCHECK, RACE, MISMATCH),
        "sm90 forward: the consumers read the K stage without waiting for its TMA",
    ),
    Mutation(
        "output_rows_overlap_next_block", "flash_fwd.cuh",
        "    int row = m0 + warp * WM + r;\n", "    int row = m0 + warp * WM + r - (m0 > 0);\n",
        # Blocks run in index order here, so the later block's store wins and the result could be
        # anything; only ThreadSanitizer, with blocks unordered, must name it first.
        "bf16_d64_tall_fwd", (RACE,),
        "mma.sync forward: each block past the first stores its rows one row up, over its neighbour's last",
    ),
    Mutation(
        "smem_index_off_by_a_row", "flash_fwd.cuh",
        "const unsigned q_ld = sQa + q_ld_off<BM, D>(warp * WM, lane);",
        "const unsigned q_ld = sQa + q_ld_off<BM, D>(warp * WM + 1, lane);",
        "bf16_d64", (MISMATCH,),
        "mma.sync forward: the Q fragment's shared-memory row is off by one",
    ),
    Mutation(
        "tma_box_off_by_a_tile", "sm90/flash_fwd_sm90.cuh",
        "c * 64, n0, kv_head, w.batch);\n        mbar_wait(bar.v_empty",
        "c * 64, n0 + Tr::kBlockN, kv_head, w.batch);\n        mbar_wait(bar.v_empty",
        "sm90_bf16_d128", (MISMATCH,),
        "sm90 forward: the K box's key coordinate is one tile ahead",
    ),
    Mutation(
        "wgmma_wait_after_accumulator_use", "sm90/flash_fwd_sm90.cuh",
        "      if constexpr (kPrev) {\n        wgmma_wait<0>();  // P V of the previous tile: its P registers and V stage are free now\n",
        "      for (int e = 0; e < kOAcc; ++e) o[e] *= corr[(e / 2) % 2];  // used before its wgmma retired\n"
        "      if constexpr (kPrev) {\n        wgmma_wait<0>();  // P V of the previous tile: its P registers and V stage are free now\n",
        # ThreadSanitizer sees it first: the rescale writes O while the tensor cores' context, which
        # writes it at the wait, is unordered with the thread (a wrong result would follow).
        "sm90_f16_d64", (RACE, MISMATCH),
        "sm90 forward: O is rescaled before the wait that retires the P V writing it",
    ),
    Mutation(
        "mbarrier_wrong_parity", "sm90/flash_fwd_sm90.cuh",
        "mbar_wait(bar.q_empty, (q_iter & 1) ^ 1);", "mbar_wait(bar.q_empty, q_iter & 1);",
        "sm90_bf16_d64", (DEADLOCK,),
        "sm90 forward: the producer waits for a phase of q_empty nobody completes",
    ),
]


def copy_workspace(dst: Path) -> Path:
    src = ROOT / "native" / "exla_rs"
    ignore = shutil.ignore_patterns("target", "__pycache__")
    shutil.copytree(src, dst / "native" / "exla_rs", ignore=ignore)
    return dst / "native" / "exla_rs"


def run_harness(ws: Path, target: Path, cases: str) -> tuple[int, str, float]:
    env = dict(os.environ)
    env.update({
        "CARGO_TARGET_DIR": str(target),
        "EXLA_RS_CUDA_NVCC": "0",  # the executor needs no nvcc; the kernels compile with g++
        "EXLA_RS_GPUSIM_SANITIZE": "thread",
        "TSAN_OPTIONS": "halt_on_error=1 exitcode=66",
    })
    t0 = time.time()
    p = subprocess.run(
        # The gpusim profile (Cargo.toml): optimised, no LTO, as scripts/gpu_on_cpu.sh builds it.
        ["cargo", "run", "--profile", "gpusim", "-q", "-p", "exla-rs-gpusim",
         "--example", "gpu_on_cpu_check", "--", "--only", cases],
        cwd=ws, env=env, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr, time.time() - t0


def first_line_with(text: str, needles: tuple[str, ...]) -> str | None:
    for line in text.splitlines():
        if any(n in line for n in needles):
            return line.strip()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", help="scratch directory to use and keep (default: a temporary one)")
    ap.add_argument("--only", help="run only the mutation of this name (and the baseline)")
    args = ap.parse_args()
    muts = [m for m in MUTATIONS if not args.only or m.name == args.only]
    if not muts:
        print(f"no mutation named {args.only!r}", file=sys.stderr)
        return 2
    scratch = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="exla_rs_mutations."))
    scratch.mkdir(parents=True, exist_ok=True)
    ws = scratch / "native" / "exla_rs"
    if ws.exists():
        shutil.rmtree(ws)
    copy_workspace(scratch)
    target = scratch / "target"
    ok = True
    try:
        # The unmodified tree, on every case set the mutations use: it must pass.
        for cases in sorted({m.cases for m in muts}):
            rc, out, secs = run_harness(ws, target, cases)
            status = "passes" if rc == 0 else f"FAILS (exit {rc})"
            print(f"unmodified tree, cases '{cases}': {status} ({secs:.0f} s)", flush=True)
            if rc != 0:
                ok = False
                print(out[-3000:])
        for m in muts:
            f = ws / "kernels" / m.path
            text = f.read_text()
            if text.count(m.old) != 1:
                print(f"{m.name}: the text to mutate occurs {text.count(m.old)} times in kernels/{m.path} (want 1): update this script")
                ok = False
                continue
            f.write_text(text.replace(m.old, m.new))
            try:
                rc, out, secs = run_harness(ws, target, m.cases)
            finally:
                f.write_text(text)
            caught = first_line_with(out, m.expect) if rc != 0 else None
            if caught:
                print(f"{m.name}: caught ({secs:.0f} s) - {m.what}\n    {caught[:300]}", flush=True)
            else:
                ok = False
                why = "ran clean" if rc == 0 else f"failed (exit {rc}) without any of {m.expect}"
                print(f"{m.name}: NOT CAUGHT, the harness {why} - {m.what}")
                print(out[-3000:])
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print("mutations: all caught, unmodified tree passes" if ok else "mutations: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
