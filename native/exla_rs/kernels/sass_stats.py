#!/usr/bin/env python3
"""Per-kernel SASS statistics of the built CUDA kernels: a signal any machine can read, no GPU needed.

For every kernel in every fatbin build.rs wrote (one per kernels/inst/*.cu) and every SASS
architecture in it: instructions, HMMA, LDSM, integer ops, local-memory accesses (LDL/STL: spills),
registers, stack and static shared memory, from `cuobjdump -sass` / `cuobjdump -res-usage`.
The Hopper set (kernels/sm90/inst, sm_90a images, kernels named sm90_*) also reports HGMMA
(wgmma) and UTMA* (the TMA copy engine: UTMALDG, UTMAPF, ...): `--check-spills` fails an sm90
image that has none of either, since it would then be running on a slower path.
`--check-regpool` reads the register budget of every kernel that moves registers with setmaxnreg
(USETMAXREG in its SASS): the block holds REG (cuobjdump -res-usage) x threads (the launch bounds the
ELF records, EIATTR_MAX_THREADS) registers, and setmaxnreg.inc waits until that pool has what it
asks, so a split that needs more hangs every launch (the sm90 forward at D = 256 did on an H200).
"Integer ops" are the integer-pipe opcodes that index, mask and address work costs (the list is
the one shared/design/facts.md counts FA2 with): IMAD, IADD3, LOP3, SHF, LEA, ISETP, SEL, IMNMX,
VIADD, PLOP3.

The key loop: a kernel's loops are its backward branches (a BRA to an earlier address; the loop
is [target, branch]); the key loop is the one holding the most HMMA (ties: the fewest
instructions, so where a kernel runs its interior key tiles in a lean loop of their own beside a
general one with the mask code, it is the lean one, and the general one shows in `loops`).
`--loop` prints its instructions, HMMA, LDSM and integer ops and their ratios per HMMA beside the
whole-kernel counts; `--check-loop` holds the plain sets' key loops to LOOP_BUDGET.

Shared memory and occupancy (issue 33 part 3): `--smem` adds each kernel's block size and shared
memory (static from -res-usage, dynamic from the launch code itself: `cargo run --example
launch_table` of exla-rs-cuda prints what every launch asks the driver for) and the blocks one SM
holds by registers, shared memory and threads: on the A100 (sm_80 images), on the RTX 30xx/40xx and
L4 (sm_86/89: they run the sm_80 images with 99 KiB of shared memory per block and 100 per SM)
and on Hopper (sm_90 images). `--check-smem` fails an image that asks for more than its GPUs
allow per block, a built kernel no launch names, and a launched kernel no fatbin holds.

    python3 native/exla_rs/kernels/sass_stats.py                  # newest release build
    python3 native/exla_rs/kernels/sass_stats.py --arch sm_90 --kernel 'bwd_.*_d256'
    python3 native/exla_rs/kernels/sass_stats.py --markdown       # the table bench/RESULTS.md holds
    python3 native/exla_rs/kernels/sass_stats.py --check-spills   # exit 1 on any LDL/STL (CI)
    python3 native/exla_rs/kernels/sass_stats.py --check          # exit 1 if the plain set grew (CI)
    python3 native/exla_rs/kernels/sass_stats.py --check-regpool  # exit 1 if a setmaxnreg split overdraws (CI)
    python3 native/exla_rs/kernels/sass_stats.py --loop --kernel 'fwd_bf16_d(64|128)$'  # the key loop's mix
    python3 native/exla_rs/kernels/sass_stats.py --check-loop     # exit 1 if a plain key loop grew (CI)
    python3 native/exla_rs/kernels/sass_stats.py --smem --check-smem  # shared memory, blocks per SM (CI)
    python3 native/exla_rs/kernels/sass_stats.py --dir DIR        # fatbins/cubins elsewhere

cuobjdump and nvdisasm come from NVIDIA's pip wheels (scripts/setup.sh puts them in the cuda
venv next to nvcc); found through CUOBJDUMP, CUDA_HOME/bin, the cuda venv, or PATH.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
INT_OPS = {"IMAD", "IADD3", "LOP3", "SHF", "LEA", "ISETP", "SEL", "IMNMX", "VIADD", "PLOP3"}
# The plain feature set's budget (issue 26), per (arch, pass, head dim): at most these instructions
# and integer ops per HMMA, for f16 and bf16 alike. They are the figures issue 13 left
# (bench/RESULTS.md, "SASS statistics", measured on bf16; f16 compiles within a few instructions of
# it), when every call still ran one kernel without optional features. The plain set (kernels named
# without a feature suffix: config.rs FeatureSet) is what most calls run, so a feature that adds to
# it, or a change that makes it grow, fails CI (`--check`) instead of slowing every call unnoticed.
PLAIN_BUDGET = {
    ("sm_80", "bwd", 32): (3711, 25.2), ("sm_80", "bwd", 64): (4022, 14.8), ("sm_80", "bwd", 96): (4430, 10.1),
    ("sm_80", "bwd", 128): (3301, 12.7), ("sm_80", "bwd", 192): (3574, 12.5), ("sm_80", "bwd", 256): (3233, 9.7),
    ("sm_90", "bwd", 32): (3926, 24.4), ("sm_90", "bwd", 64): (4275, 14.2), ("sm_90", "bwd", 96): (4750, 9.8),
    ("sm_90", "bwd", 128): (3691, 11.2), ("sm_90", "bwd", 192): (3933, 12.6), ("sm_90", "bwd", 256): (3528, 9.7),
}
# The backward's plain set since issue 33 part 1 (2026-11-28, bf16 = f16, plus about 2%): a lean
# loop for the query tiles that see every key of the block beside the general one (not at
# D = 192, which keeps the general loop alone), so the kernel holds 30-38% more instructions
# while the loop those tiles run holds 3.1-5.6 instructions per HMMA instead of 10.7-29.8
# (LOOP_BUDGET); integer ops per HMMA of the whole kernel fell by a third or more.
PLAIN_BUDGET.update({
    ("sm_80", "bwd", 32): (3931, 12.0), ("sm_80", "bwd", 64): (4471, 6.7), ("sm_80", "bwd", 96): (5535, 5.7),
    ("sm_80", "bwd", 128): (4087, 5.9), ("sm_80", "bwd", 192): (3375, 11.8), ("sm_80", "bwd", 256): (3960, 5.8),
    ("sm_90", "bwd", 32): (4093, 11.5), ("sm_90", "bwd", 64): (4752, 5.8), ("sm_90", "bwd", 96): (5911, 5.6),
    ("sm_90", "bwd", 128): (4373, 5.7), ("sm_90", "bwd", 192): (3758, 12.0), ("sm_90", "bwd", 256): (4282, 5.4),
})
# The forward's plain set since issue 33 (2026-11-27, bf16 = f16, plus about 2%): two key loops, a
# lean one for the interior tiles and the general one with the mask code, so the kernel holds
# more instructions (the instruction budget grew by 10-37%) while the loop the interior tiles run
# holds 3.7-7.5 instructions per HMMA instead of 14-48 (LOOP_BUDGET); integer ops per HMMA of the
# whole kernel fell by half or more.
PLAIN_BUDGET.update({
    ("sm_80", "fwd", 32): (3008, 12.8), ("sm_80", "fwd", 64): (3537, 7.4), ("sm_80", "fwd", 96): (3483, 8.4),
    ("sm_80", "fwd", 128): (3225, 4.7), ("sm_80", "fwd", 192): (3812, 10.9), ("sm_80", "fwd", 256): (3623, 6.6),
    ("sm_90", "fwd", 32): (3045, 12.6), ("sm_90", "fwd", 64): (3579, 7.2), ("sm_90", "fwd", 96): (3545, 8.3),
    ("sm_90", "fwd", 128): (3269, 4.6), ("sm_90", "fwd", 192): (3946, 10.9), ("sm_90", "fwd", 256): (3690, 6.5),
})
# The split-KV forward's plain set (issue 34, flash_fwd_split.cuh: decode calls), as "split": its
# figures with issue 33's 32-bit shared addresses (2026-11-27, bf16 = f16) plus about 2%.
PLAIN_BUDGET.update({
    ("sm_80", "split", 32): (2644, 39.1), ("sm_80", "split", 64): (3060, 22.8), ("sm_80", "split", 96): (3480, 17.6),
    ("sm_80", "split", 128): (3475, 11.9), ("sm_80", "split", 192): (3814, 21.8), ("sm_80", "split", 256): (3470, 12.2),
    ("sm_90", "split", 32): (2682, 37.5), ("sm_90", "split", 64): (3095, 21.8), ("sm_90", "split", 96): (3552, 17.2),
    ("sm_90", "split", 128): (3518, 11.4), ("sm_90", "split", 192): (3952, 21.5), ("sm_90", "split", 256): (3495, 11.6),
})
PLAIN = re.compile(r"^(fwd|bwd|fwd_split)_b?f16_d(\d+)$")
# The plain sets' key loops (issue 33): at most these instructions and integer ops per HMMA in the
# loop holding the most HMMA, per (arch, pass, head dim), f16 and bf16 alike (one decimal, as
# printed): the figures of 2026-11-27 plus about 2% (+0.05). Issue 33's bar for the forward at
# D = 64 and 128 on sm_80 is 6 and 1.5; the split kernel (decode, one general loop) holds today's
# figures. The backward's (2026-11-28, plus about 2%): its lean loop (issue 33 part 1) at every
# D but 192, whose general loop keeps the figures it had; the bar at D = 64 and 128 on sm_80 is 8
# and 2.
LOOP_BUDGET: dict[tuple[str, str, int], tuple[float, float]] = {
    ("sm_80", "fwd", 32): (7.8, 0.4), ("sm_80", "fwd", 64): (5.0, 0.3), ("sm_80", "fwd", 96): (4.7, 0.6),
    ("sm_80", "fwd", 128): (3.9, 0.3), ("sm_80", "fwd", 192): (4.6, 0.7), ("sm_80", "fwd", 256): (4.4, 0.8),
    ("sm_80", "split", 32): (41.6, 10.2), ("sm_80", "split", 64): (23.2, 5.9), ("sm_80", "split", 96): (18.1, 5.4),
    ("sm_80", "split", 128): (13.8, 3.6), ("sm_80", "split", 192): (17.8, 7.9), ("sm_80", "split", 256): (11.7, 3.7),
    ("sm_80", "bwd", 32): (5.7, 1.0), ("sm_80", "bwd", 64): (3.8, 0.6), ("sm_80", "bwd", 96): (3.7, 0.8),
    ("sm_80", "bwd", 128): (3.2, 0.6), ("sm_80", "bwd", 192): (12.2, 5.4), ("sm_80", "bwd", 256): (3.2, 0.5),
    ("sm_90", "fwd", 32): (7.8, 0.4), ("sm_90", "fwd", 64): (5.0, 0.3), ("sm_90", "fwd", 96): (4.7, 0.6),
    ("sm_90", "fwd", 128): (3.9, 0.3), ("sm_90", "fwd", 192): (4.5, 0.7), ("sm_90", "fwd", 256): (4.4, 0.8),
    ("sm_90", "split", 32): (41.9, 9.3), ("sm_90", "split", 64): (23.4, 5.5), ("sm_90", "split", 96): (18.6, 5.4),
    ("sm_90", "split", 128): (13.9, 3.4), ("sm_90", "split", 192): (18.6, 7.9), ("sm_90", "split", 256): (11.6, 3.4),
    ("sm_90", "bwd", 32): (5.7, 1.0), ("sm_90", "bwd", 64): (3.8, 0.7), ("sm_90", "bwd", 96): (3.7, 0.9),
    ("sm_90", "bwd", 128): (3.2, 0.6), ("sm_90", "bwd", 192): (13.6, 5.7), ("sm_90", "bwd", 256): (3.2, 0.5),
}
# The bar itself, checked beside the budget: a budget raised past it fails too.
LOOP_BAR = {("fwd", 64): (6.0, 1.5), ("fwd", 128): (6.0, 1.5), ("bwd", 64): (8.0, 2.0), ("bwd", 128): (8.0, 2.0)}

# USETMAXREG.DEALLOC n (setmaxnreg.dec) / USETMAXREG.TRY_ALLOC UPx, n (setmaxnreg.inc, retried until
# the block's pool grants it).
SETMAXNREG = re.compile(r"USETMAXREG\.(DEALLOC|TRY_ALLOC)\S*\s+(?:U?P\w+\s*,\s*)?(0x[0-9a-fA-F]+|\d+)\s*;")
INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]*)?\b(.*)$")
BRA_TARGET = re.compile(r"(0x[0-9a-f]+)\s*;")


# Per-SM and per-block limits of the GPUs each SASS image runs on (CUDA C Programming Guide,
# "Technical Specifications per Compute Capability"): (name, registers per SM, shared memory per SM,
# per block (opt-in), threads per SM, blocks per SM). Each block also takes 1 KiB of shared memory
# the system reserves. The sm_80 images run on 8.0 (A100) and, unchanged, on 8.6/8.9.
HOPPER = [("H100", 65536, 228 * 1024, 227 * 1024, 2048, 32)]
GPUS = {
    "sm_80": [("A100", 65536, 164 * 1024, 163 * 1024, 2048, 32), ("sm_86/89", 65536, 100 * 1024, 99 * 1024, 1536, 16)],
    "sm_90": HOPPER,
    "sm_90a": HOPPER,
}


def load_launches(path: str | None) -> dict[str, dict]:
    """{kernel (without exla_rs_): {threads, smem}} from launch_table's output: a file holding it,
    the built example itself (an executable: CI runs the one `cargo test` built), or by running
    the example through cargo (the release profile the kernels were built with)."""
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        r = subprocess.run([path], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"sass_stats: {path} failed:\n{r.stderr}")
        text = r.stdout
    elif path:
        text = Path(path).read_text()
    else:
        cmd = ["cargo", "run", "--release", "-q", "--manifest-path", str(ROOT / "native/exla_rs/Cargo.toml"),
               "-p", "exla-rs-cuda", "--example", "launch_table"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"sass_stats: {' '.join(cmd)} failed:\n{r.stderr}")
        text = r.stdout
    out = {}
    for line in text.splitlines()[1:]:
        kernel, threads, smem, _file = line.split("\t")
        out[kernel.removeprefix("exla_rs_")] = {"threads": int(threads), "smem": int(smem)}
    if not out:
        sys.exit("sass_stats: the launch table is empty")
    return out


def occupancy(arch: str, r: dict, launch: dict | None) -> list[tuple[str, int | None, str | None]]:
    """Per GPU the image runs on: (GPU, blocks per SM, why none fit or None)."""
    out = []
    for name, regs_sm, smem_sm, smem_block, threads_sm, blocks_sm in GPUS.get(arch, []):
        if launch is None or r["regs"] < 0:
            out.append((name, None, None))
            continue
        threads, smem = launch["threads"], launch["smem"] + r["static_smem"]
        if smem > smem_block:
            out.append((name, 0, f"{smem} bytes of shared memory per block; {name} allows {smem_block}"))
            continue
        # Registers are allocated per warp in units of 256 (8 per thread).
        by_regs = regs_sm // (((r["regs"] + 7) // 8 * 8) * 32 * ((threads + 31) // 32))
        by_smem = smem_sm // (smem + 1024)
        n = min(by_regs, by_smem, threads_sm // threads, blocks_sm)
        out.append((name, n, None if n else f"{r['regs']} registers x {threads} threads exceed {name}'s {regs_sm}"))
    return out


def find_cuobjdump() -> str:
    cands = [os.environ.get("CUOBJDUMP")]
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "cuobjdump"))
    cands += glob.glob(str(ROOT / ".venv/cuda/lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump"))
    cands.append(shutil.which("cuobjdump"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("sass_stats: cuobjdump not found (set CUOBJDUMP or CUDA_HOME, or run scripts/setup.sh)")


def default_dir() -> Path:
    """The exla-rs-cuda build output holding fatbins that was written last (release first)."""
    outs = []
    for prof in ("release", "debug"):
        for d in glob.glob(str(ROOT / f"native/exla_rs/target/{prof}/build/exla-rs-cuda-*/out")):
            fb = glob.glob(os.path.join(d, "*.fatbin"))
            if fb:
                outs.append((max(os.path.getmtime(f) for f in fb), d))
        if outs:
            break
    if not outs:
        sys.exit("sass_stats: no fatbins found; build first (cargo build --release ... with nvcc)")
    return Path(max(outs)[1])


def run(tool: str, args: list[str]) -> str:
    env = dict(os.environ)
    # cuobjdump -sass runs nvdisasm, which the pip wheel installs beside it.
    env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")
    r = subprocess.run([tool, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"sass_stats: {tool} {' '.join(args)} failed:\n{r.stderr}")
    return r.stdout


def stats_of(tool: str, path: Path) -> dict[tuple[str, str], dict]:
    """{(arch, kernel): stats} for one fatbin or cubin."""
    sass = run(tool, ["-sass", str(path)])
    # The ELF (launch bounds) only where a kernel moves registers: the dump is large.
    elf = run(tool, ["-elf", str(path)]) if "USETMAXREG" in sass else ""
    return parse_dumps(sass, run(tool, ["-res-usage", str(path)]), elf)


def parse_dumps(sass: str, res_usage: str, elf: str = "") -> dict[tuple[str, str], dict]:
    """{(arch, kernel): stats} from cuobjdump's -sass, -res-usage and -elf texts of one file."""
    out: dict[tuple[str, str], dict] = defaultdict(lambda: {"ops": Counter(), "setmaxnreg": [], "insns": []})
    archs = set(re.findall(r"code for (sm_\w+)", sass))
    # A cubin's -res-usage names no arch: it is the one its SASS is for.
    arch = archs.pop() if len(archs) == 1 else None
    first_arch = arch
    for line in res_usage.splitlines():
        m = re.match(r"\s*arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            fn = m.group(1)
            continue
        m = re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and arch:
            s = out[(arch, fn)]
            s["regs"], s["stack"], s["static_smem"], s["local"] = map(int, m.groups())
    # -elf: each image starts with "arch = ..." (a cubin: none), each kernel's attributes sit in
    # its .nv.info.<kernel> section; EIATTR_MAX_THREADS's value is the next "Value:" line (x y z).
    arch, fn, want = first_arch, None, False
    for line in elf.splitlines():
        m = re.match(r"\s*arch = (sm_\w+)", line)
        if m:
            arch, fn = m.group(1), None
            continue
        m = re.match(r"\.nv\.info\.(\S+)\s*$", line)
        if m:
            fn = m.group(1)
            continue
        if "EIATTR_MAX_THREADS" in line:
            want = True
            continue
        m = re.match(r"\s*Value:\s*((?:0x[0-9a-fA-F]+\s*)+)$", line)
        if want and m and arch and fn:
            x, y, z = (int(v, 16) for v in m.group(1).split())
            out[(arch, fn)]["max_threads"] = x * y * z
            want = False
    arch = fn = None
    for line in sass.splitlines():
        m = re.match(r"\s*code for (sm_\w+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            fn = m.group(1)
            continue
        m = INSN.match(line)
        if m and arch and fn:
            op = m.group(3)
            out[(arch, fn)]["ops"][op] += 1
            tgt = None
            if op == "BRA":
                b = BRA_TARGET.search(m.group(4))
                tgt = int(b.group(1), 16) if b else None
            # An unpredicated EXIT is marked as the pseudo-target "exit" (key_loop).
            if op == "EXIT" and not m.group(2):
                tgt = "exit"
            out[(arch, fn)]["insns"].append((int(m.group(1), 16), op, tgt))
            r = SETMAXNREG.search(line)
            if r:
                out[(arch, fn)]["setmaxnreg"].append((r.group(1), int(r.group(2), 0)))
    return dict(out)


def regpool(s: dict) -> dict | None:
    """The register pool of a kernel that runs setmaxnreg, or None. Which warpgroup runs which
    USETMAXREG is not in the SASS's text, so the need is the kernels' layout at its largest: one
    producer warpgroup (128 threads) at the smallest count and every other thread at the largest:
    128 * min + (threads - 128) * max, against REG x threads (the pool at launch)."""
    counts = [n for _, n in s.get("setmaxnreg", [])]
    if not counts:
        return None
    threads, regs = s.get("max_threads"), s.get("regs", -1)
    producer, consumer = min(counts), max(counts)
    r = dict(regs=regs, threads=threads, producer=producer, consumer=consumer, pool=None, need=None, problem=None)
    if not threads:
        r["problem"] = "no EIATTR_MAX_THREADS (__launch_bounds__) in its ELF: the launch pool is unknown"
    elif threads < 256 or regs < 0:
        r["problem"] = f"{threads} threads, REG {regs}: not a producer warpgroup plus consumers"
    else:
        r["pool"], r["need"] = regs * threads, 128 * producer + (threads - 128) * consumer
        if r["need"] > r["pool"]:
            r["problem"] = (f"setmaxnreg needs 128 x {producer} + {threads - 128} x {consumer} = {r['need']} registers, "
                            f"the block holds {regs} x {threads} = {r['pool']} at launch: setmaxnreg.inc never completes")
    return r


# The check's own proof, from cuobjdump's dumps of sm90_fwd_bf16_d256 as built on 2026-11-27 (it
# hung on an H200: setmaxnreg 48 / 232, 168 registers x 384 threads) and with today's 40 / 232.
SELFTEST_SASS = """
\tcode for sm_90a
\t\tFunction : exla_rs_sm90_fwd_bf16_d256
        /*02e0*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;                            /* 0x000000e8000079c8 */
        /*fab0*/                   USETMAXREG.DEALLOC.CTAPOOL {dealloc} ;                                   /* 0x00000030000079c8 */
"""
SELFTEST_RES = """
 Function exla_rs_sm90_fwd_bf16_d256:
  REG:168 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:1152 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
SELFTEST_ELF = """
.nv.info.exla_rs_sm90_fwd_bf16_d256
\tAttribute:\tEIATTR_MAX_THREADS
\tFormat:\tEIFMT_SVAL
\tValue:\t0x180 0x1 0x1 
"""


def regpool_selftest() -> str | None:
    """None when the check rejects the split that hung and accepts the one that fits."""
    for dealloc, bad in (("0x30", True), ("0x28", False)):
        stats = parse_dumps(SELFTEST_SASS.format(dealloc=dealloc), SELFTEST_RES, SELFTEST_ELF)
        r = regpool(stats[("sm_90a", "exla_rs_sm90_fwd_bf16_d256")])
        if r is None or r["threads"] != 384 or bool(r["problem"]) != bad:
            return f"setmaxnreg {int(dealloc, 16)}/232 at 168 x 384: got {r}"
    return None


def key_loop(insns: list) -> dict | None:
    """The loop holding the most HMMA (ties: the fewest instructions) of one kernel's instruction
    list [(address, opcode, branch target or None)], or None without a loop holding one. A loop is
    [target, branch] of a backward BRA. A range holding an unpredicated EXIT (its target "exit") is
    not one: the branch is an out-of-line block after the kernel's end (ptxas puts the divergent
    path of a warp vote there, a CALL and a BRA back to where the vote was), and its range would
    run from the vote over every loop after it."""
    loops = []
    at = {a: i for i, (a, _, _) in enumerate(insns)}
    exits = [a for a, op, tgt in insns if op == "EXIT" and tgt == "exit"]
    for i, (a, op, tgt) in enumerate(insns):
        if op == "BRA" and tgt is not None and tgt <= a and tgt in at:
            if any(tgt <= x <= a for x in exits):
                continue
            ops = Counter(o for _, o, _ in insns[at[tgt]:i + 1])
            n = sum(v for k, v in ops.items() if k != "NOP")
            if ops["HMMA"]:
                loops.append(dict(start=tgt, end=a, insts=n, hmma=ops["HMMA"], ldsm=ops["LDSM"],
                                  int=sum(ops[k] for k in INT_OPS)))
    if not loops:
        return None
    best = max(loops, key=lambda l: (l["hmma"], -l["insts"]))
    h = best["hmma"]
    return dict(best, insts_per_hmma=best["insts"] / h, int_per_hmma=best["int"] / h, ldsm_per_hmma=best["ldsm"] / h,
                loops=len(loops))


def summarize(s: dict) -> dict:
    ops: Counter = s["ops"]
    n = sum(v for k, v in ops.items() if k != "NOP")
    hmma = ops["HMMA"]
    integer = sum(ops[k] for k in INT_OPS)
    return dict(
        insts=n, hmma=hmma, hgmma=ops["HGMMA"], utma=sum(v for k, v in ops.items() if k.startswith("UTMA")), ldsm=ops["LDSM"], int=integer, ldl=ops["LDL"], stl=ops["STL"],
        regs=s.get("regs", -1), stack=s.get("stack", -1), static_smem=s.get("static_smem", 0),
        int_per_hmma=(integer / hmma) if hmma else None, ldsm_per_hmma=(ops["LDSM"] / hmma) if hmma else None,
        regpool=regpool(s), loop=key_loop(s.get("insns", [])),
    )


# Spills known and bounded: (arch, kernel) -> the most LDL + STL instructions allowed. Every other
# image must have none, and these no more. The backward's masks-and-terms sets at D = 192 sit at
# 255 registers on sm_90 and keep one 32-bit value in local memory (one STL before the key loop,
# one LDL per step: a pointer half). Every rearrangement tried on 2026-11-25 (interval bounds
# outside the branch, dropout bits early, the bias base folded into the pointers, ptxas options)
# moved the spill to other sets or made it larger; the pre-split kernel had the same 255. The fix
# is fewer live 64-bit addresses (32-bit shared-memory addresses for the hoisted tile pointers).
KNOWN_SPILLS = {("sm_90", f"bwd_{dt}_d192_{fs}"): 2 for dt in ("f16", "bf16") for fs in ("mask", "mask_drop")}


def check_plain_budget(rows) -> tuple[list[str], int]:
    """(the plain-set images over PLAIN_BUDGET, described; how many images had a budget)."""
    over, checked = [], 0
    for arch, fn, r in rows:
        m = PLAIN.match(fn)
        budget = m and PLAIN_BUDGET.get((arch, m.group(1).replace("fwd_split", "split"), int(m.group(2))))
        if not budget:
            continue
        checked += 1
        insts, per_hmma = budget
        # Integer ops per HMMA as the budget table prints it: one decimal.
        ratio = round(r["int_per_hmma"], 1) if r["int_per_hmma"] is not None else float("inf")
        if r["insts"] > insts or ratio > per_hmma:
            over.append(f"{arch} {fn}: {r['insts']} instructions (budget {insts}), "
                        f"{ratio:.1f} integer ops per HMMA (budget {per_hmma:.1f})")
    return over, checked


def check_loop_budget(rows) -> tuple[list[str], int]:
    """(the plain-set images whose key loop is over LOOP_BUDGET, described; how many were checked)."""
    over, checked = [], 0
    for arch, fn, r in rows:
        m = PLAIN.match(fn)
        budget = m and LOOP_BUDGET.get((arch, m.group(1).replace("fwd_split", "split"), int(m.group(2))))
        if not budget:
            continue
        checked += 1
        lp = r["loop"]
        if lp is None:
            over.append(f"{arch} {fn}: no loop holds an HMMA")
            continue
        per, ints = round(lp["insts_per_hmma"], 1), round(lp["int_per_hmma"], 1)
        bar = LOOP_BAR.get((m.group(1), int(m.group(2))), (float("inf"),) * 2) if arch == "sm_80" else (float("inf"),) * 2
        if per > min(budget[0], bar[0]) or ints > min(budget[1], bar[1]):
            over.append(f"{arch} {fn}: key loop {lp['insts']} instructions for {lp['hmma']} HMMA: {per:.1f} per HMMA "
                        f"(budget {budget[0]:.1f}), {ints:.1f} integer ops per HMMA (budget {budget[1]:.1f})")
    return over, checked


def smem_report(rows, launches: dict[str, dict], a) -> int:
    """The --smem table and the --check-smem verdicts; returns 1 on a failed check."""
    problems = []
    if a.smem:
        print("# shared memory (static + the launch's dynamic, bytes) and blocks per SM, limited by registers, shared memory, threads")
        if a.markdown:
            print("| arch | kernel | threads | regs | smem | blocks per SM |")
            print("| --- | --- | --- | --- | --- | --- |")
        else:
            print(f"{'arch':7} {'kernel':24} {'threads':>7} {'regs':>4} {'smem':>7}  blocks per SM")
    for arch, fn, r in rows:
        launch = launches.get(fn)
        occ = occupancy(arch, r, launch)
        for gpu, _, why in occ:
            if why:
                problems.append(f"{arch} {fn} cannot launch on {gpu}: {why}")
        if launch is None:
            problems.append(f"{arch} {fn}: built, but no launch names it (launch_table)")
        if a.smem:
            threads = launch["threads"] if launch else "-"
            smem = launch["smem"] + r["static_smem"] if launch else "-"
            per_gpu = ", ".join(f"{g} {'-' if n is None else n}" for g, n, _ in occ)
            if a.markdown:
                print(f"| {arch} | {fn} | {threads} | {r['regs']} | {smem} | {per_gpu} |")
            else:
                print(f"{arch:7} {fn:24} {threads:>7} {r['regs']:4} {smem:>7}  {per_gpu}")
    # Only a full listing can tell a launched kernel that no fatbin holds.
    if not a.arch and not a.kernel:
        built = {fn for _, fn, _ in rows}
        problems += [f"{k}: launched (launch_table) but in no fatbin" for k in sorted(launches) if k not in built]
    if a.check_smem:
        for p in problems:
            print(f"SHARED MEMORY / LAUNCH: {p}", file=sys.stderr)
        print(f"# shared memory: {len(rows)} kernel images checked against their GPUs' per-block limits, "
              f"{len(problems)} problem(s)", file=sys.stderr)
        return 1 if problems else 0
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, help="directory of *.fatbin / *.cubin (default: newest build)")
    ap.add_argument("--arch", help="only this SASS arch (sm_80, sm_90, ...)")
    ap.add_argument("--kernel", help="only kernels matching this regex (searched in the name)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--check-spills", action="store_true", help="exit 1 if any kernel has LDL/STL (beyond KNOWN_SPILLS)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a plain-set kernel exceeds its instruction or integer-ops-per-HMMA budget")
    ap.add_argument("--loop", action="store_true",
                    help="add the key loop's columns (the loop holding the most HMMA): instructions, HMMA, LDSM, integer ops, per HMMA")
    ap.add_argument("--check-loop", action="store_true",
                    help="exit 1 if a plain-set kernel's key loop exceeds its instructions or integer ops per HMMA (LOOP_BUDGET)")
    ap.add_argument("--check-regpool", action="store_true",
                    help="exit 1 if a setmaxnreg kernel's producer/consumer split needs more registers than its launch pool")
    ap.add_argument("--smem", action="store_true",
                    help="add threads, shared memory (static + the launch's dynamic) and blocks per SM per GPU")
    ap.add_argument("--check-smem", action="store_true",
                    help="exit 1 if an image needs more shared memory per block than its GPUs allow, or a kernel is built but never launched (or launched but not built)")
    ap.add_argument("--launches", help="launch_table's output (a file), or the built example to run (default: cargo run --example launch_table)")
    a = ap.parse_args()
    launches = load_launches(a.launches) if (a.smem or a.check_smem) else {}
    tool = find_cuobjdump()
    d = a.dir or default_dir()
    files = sorted(glob.glob(str(d / "*.fatbin")) + glob.glob(str(d / "*.cubin")))
    if not files:
        sys.exit(f"sass_stats: no *.fatbin or *.cubin in {d}")
    rows = []
    # cuobjdump per file, one per core (CI's step was 200 s on 2 cores one file at a time).
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        per_file = list(pool.map(lambda f: stats_of(tool, Path(f)), files))
    for stats in per_file:
        for (arch, fn), s in stats.items():
            if a.arch and arch != a.arch:
                continue
            if a.kernel and not re.search(a.kernel, fn):
                continue
            rows.append((arch, fn.removeprefix("exla_rs_"), summarize(s)))
    rows.sort(key=lambda r: (int(re.sub(r"\D", "", r[0]) or 0), r[1]))
    ratio = lambda x: "-" if x is None else f"{x:.1f}"
    def loop_cols(r, md):
        lp = r["loop"]
        if lp is None:
            cells = ["-"] * 8
        else:
            cells = [str(lp["loops"]), str(lp["insts"]), str(lp["hmma"]), str(lp["ldsm"]), str(lp["int"]),
                     f"{lp['insts_per_hmma']:.2f}", f"{lp['int_per_hmma']:.2f}", f"{lp['ldsm_per_hmma']:.2f}"]
        if md:
            return "".join(f" {c} |" for c in cells)
        return "".join(f" {c:>{w}}" for c, w in zip(cells, (5, 6, 5, 5, 5, 7, 7, 7)))
    if a.markdown:
        lh = " loops | loop insts | loop HMMA | loop LDSM | loop int | insts/HMMA | int/HMMA | LDSM/HMMA |" if a.loop else ""
        print("| arch | kernel | insts | HMMA | HGMMA | UTMA | LDSM | int ops | int/HMMA | LDL | STL | regs |" + lh)
        print("|" + " --- |" * (12 + (8 if a.loop else 0)))
        for arch, fn, r in rows:
            print(f"| {arch} | {fn} | {r['insts']} | {r['hmma']} | {r['hgmma']} | {r['utma']} | {r['ldsm']} | {r['int']} | {ratio(r['int_per_hmma'])} | {r['ldl']} | {r['stl']} | {r['regs']} |"
                  + (loop_cols(r, True) if a.loop else ""))
    else:
        lh = f" {'loops':>5} {'L-ins':>6} {'L-MMA':>5} {'L-LDS':>5} {'L-int':>5} {'ins/MMA':>7} {'int/MMA':>7} {'LDS/MMA':>7}" if a.loop else ""
        print(f"{'arch':7} {'kernel':24} {'insts':>6} {'HMMA':>5} {'HGMMA':>5} {'UTMA':>4} {'LDSM':>5} {'int':>5} {'int/HMMA':>8} {'LDL':>4} {'STL':>4} {'regs':>4} {'stack':>5}" + lh)
        for arch, fn, r in rows:
            print(f"{arch:7} {fn:24} {r['insts']:6} {r['hmma']:5} {r['hgmma']:5} {r['utma']:4} {r['ldsm']:5} {r['int']:5} {ratio(r['int_per_hmma']):>8} "
                  f"{r['ldl']:4} {r['stl']:4} {r['regs']:4} {r['stack']:5}" + (loop_cols(r, False) if a.loop else ""))
    print(f"# {len(rows)} kernel images from {d}", file=sys.stderr)
    spills = [(arch, fn, r) for arch, fn, r in rows if r["ldl"] or r["stl"]]
    known = [(arch, fn, r) for arch, fn, r in spills if r["ldl"] + r["stl"] <= KNOWN_SPILLS.get((arch, fn), 0)]
    spills = [s for s in spills if s not in known]
    # An sm90 kernel without wgmma or TMA in its SASS has fallen off the Hopper path.
    off_path = [(arch, fn, r) for arch, fn, r in rows if fn.startswith("sm90_") and not (r["hgmma"] and r["utma"])]
    rc = 0
    if a.smem or a.check_smem:
        rc |= smem_report(rows, launches, a)
    if a.check_regpool:
        pools = [(arch, fn, r["regpool"]) for arch, fn, r in rows if r["regpool"]]
        print("# register pools of the setmaxnreg kernels: need = 128 x producer + (threads - 128) x consumer <= pool = REG x threads")
        print(f"{'arch':7} {'kernel':24} {'REG':>4} {'threads':>7} {'pool':>6} {'producer':>8} {'consumer':>8} {'need':>6}  verdict")
        for arch, fn, p in pools:
            print(f"{arch:7} {fn:24} {p['regs']:4} {p['threads'] or '-':>7} {p['pool'] or '-':>6} {p['producer']:8} {p['consumer']:8} "
                  f"{p['need'] or '-':>6}  {'FAIL' if p['problem'] else 'ok'}")
        for arch, fn, p in pools:
            if p["problem"]:
                print(f"REGISTER POOL: {arch} {fn}: {p['problem']}", file=sys.stderr)
                rc = 1
        err = regpool_selftest()
        if err:
            print(f"sass_stats: --check-regpool self-test failed (the check would miss the hang): {err}", file=sys.stderr)
            rc = 1
        if not pools and not a.arch and not a.kernel and any(fn.startswith("sm90_") for _, fn, _ in rows):
            print("sass_stats: sm90 kernels without USETMAXREG: the register split is gone from their SASS", file=sys.stderr)
            rc = 1
        print(f"# register pools: {sum(1 for *_, p in pools if not p['problem'])} of {len(pools)} setmaxnreg kernel images fit; "
              f"self-test (48/232 at D = 256 rejected, 40/232 accepted) {'FAILED' if err else 'ok'}", file=sys.stderr)
    budget_checks = [(a.check, check_plain_budget, "OVER BUDGET", "a budget (sm_80 / sm_90 fwd/bwd f16/bf16)",
                      "# plain set: {} of {} kernel images within budget"),
                     (a.check_loop, check_loop_budget, "KEY LOOP OVER BUDGET", "a key-loop budget",
                      "# key loops: {} of {} plain-set kernel images within LOOP_BUDGET")]
    for wanted, check, over_tag, none_what, summary in budget_checks:
        if not wanted:
            continue
        over, checked = check(rows)
        for line in over:
            print(f"{over_tag}: {line}", file=sys.stderr)
        if not checked:
            print(f"sass_stats: no plain-set kernel image with {none_what}", file=sys.stderr)
            return 1
        print(summary.format(checked - len(over), checked), file=sys.stderr)
        if over:
            rc = 1
    if a.check_spills:
        for arch, fn, r in known:
            print(f"known spill (KNOWN_SPILLS): {arch} {fn}: {r['stl']} STL, {r['ldl']} LDL, stack {r['stack']} bytes", file=sys.stderr)
        for arch, fn, r in spills:
            print(f"SPILL: {arch} {fn}: {r['stl']} STL, {r['ldl']} LDL, stack {r['stack']} bytes", file=sys.stderr)
        for arch, fn, r in off_path:
            print(f"NOT HOPPER: {arch} {fn}: {r['hgmma']} HGMMA, {r['utma']} UTMA*", file=sys.stderr)
        if not rows:
            print("sass_stats: no kernels matched", file=sys.stderr)
            return 1
        if spills or off_path:
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
