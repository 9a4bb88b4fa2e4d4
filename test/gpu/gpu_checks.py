#!/usr/bin/env python3
"""Every GPU check of exla_rs inside one short GPU window (issue 31): run_gpu_checks.sh calls this.

Steps (--steps, default all):
  env          the GPU, driver, jax/torch versions, the library under test
  tests-mma    every test of test/gpu/test_cuda_xla.py on the mma.sync kernels (EXLA_RS_CUDA_PATH=mma)
  tests-sm90   the same tests with EXLA_RS_CUDA_PATH=sm90 (the wgmma/TMA kernels where they apply)
  sanitize     compute-sanitizer memcheck, racecheck, synccheck and initcheck on both paths over
               a selection that launches every kernel image, in pieces of a few tests each
  bench        bench/bench_cuda.py --quick, alone on the GPU once everything else has stopped

The tests of both paths and the sanitizer pieces share one pool of --jobs processes (test shards
first). Each shard or piece is a pytest child in its own process group (start_new_session), given
its test ids in a file; the gpu_watch plugin writes a line when each test starts and ends. A test
running past its deadline is HUNG: the whole group is killed (a hung kernel ignores SIGINT; a
sanitizer's Python child dies with it), and the shard restarts with the tests it had left. A child
that dies inside a test (a crash, compute-sanitizer's own exit 139) is handled the same way
(CRASHED). Whatever is still running at the phase deadline is killed and its tests reported as not
run. So every test ends up passed, failed, skipped, hung, crashed or not run, by name.

Everything lands in --out, at most 8 files: summary.txt (one line per step, the failing, hung and
crashed test ids, the sanitizer error summaries, the benchmark table, and last `N passed, N
failed`), tests.log and sanitize.log (the children's output, concatenated), bench.log, bench.md.

--platform cpu runs the same machinery on a machine without a GPU against the Host handlers
(EXLA_RS_TEST_PLATFORM=cpu; GPU-only steps skipped, the bench step runs bench_cuda.py --selftest),
so the plumbing (deadlines, HUNG, restarts, the summary) is checked in CI:
test/gpu/test_run_gpu_checks.py injects a hang with EXLA_RS_TEST_HANG (gpu_watch.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = "test/gpu/test_cuda_xla.py"
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Tests under the sanitizers: together they launch every kernel image at least once (the plain,
# mask and dropout feature sets of each dtype and head dim, forward and backward, the auxiliary
# kernels, and with EXLA_RS_CUDA_PATH=sm90 each sm90 forward and backward image), at
# small sizes: the backward test runs the forward first, the extras and dropout tests run both
# passes.
SANITIZE_MMA = re.compile(
    r"test_backward_matches_float64_reference\[d(32|64|96|128|192|256)_ragged-(f16|bf16|f32)_1\]"  # plain sets, f32, aux
    r"|test_extras_forward_and_backward_match_float64\[feature_set_mask-d(32|64|96|128|192|256)-(f16|bf16|f32)\]"  # mask sets, dbias
    r"|test_dropout_forward_backward_match_float64\[(plain|everything)-(32|64|96|128|192|256)-(f16|bf16)\]")  # drop, mask_drop sets
SANITIZE_SM90 = re.compile(
    r"test_backward_matches_float64_reference\[d(64|128|256)_ragged-(f16|bf16)_1\]"  # plain sets, the sm90 backward (D = 64, 128, 256)
    r"|test_extras_forward_and_backward_match_float64\[feature_set_mask-d(64|128|256)-(f16|bf16)\]"  # _mask sets, fwd and bwd (issue 32, part 3)
    r"|test_dropout_forward_backward_match_float64\[(plain|everything)-(64|128|256)-(f16|bf16)\]")  # _drop, _mask_drop sets, fwd and bwd (D = 256: bwd only)
NVRTC_SELECT = re.compile(r"test_(forward|backward)_matches_float64_reference\[d(32|64|96|128|192|256)_ragged-(bf16|f32)_0\]")
OUTCOMES = ("passed", "failed", "error", "skipped", "hung", "crashed", "not run")


def log(msg):
    print(f"[gpu_checks {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Task:
    """One pytest child: a test shard or a sanitizer piece, restarted after a hung or crashed test."""
    step: str  # tests-mma, tests-sm90, memcheck-mma, ...
    label: str
    ids: list
    env: dict
    prefix: list  # e.g. compute-sanitizer ... (empty for plain tests)
    test_deadline: float
    results: dict = field(default_factory=dict)  # id -> (outcome, seconds, message, params)
    output: list = field(default_factory=list)  # the children's output, in order
    proc: subprocess.Popen | None = None
    events_path: str = ""
    events_pos: int = 0
    current: tuple | None = None  # (id, start time, params) of the test running now
    restarts: int = 0
    done: bool = False
    out_path: str = ""
    exit_code: int | None = None
    first_start: float = 0.0
    end_time: float = 0.0
    retried: set = field(default_factory=set)  # sanitizer tests rerun once after a crash

    def remaining(self):
        return [i for i in self.ids if i not in self.results]


class Runner:
    def __init__(self, python, base_env, workdir):
        self.python, self.base_env, self.workdir = python, base_env, Path(workdir)
        self.n = 0

    def start(self, t: Task):
        rest = t.remaining()
        if not rest:
            t.done = True
            t.end_time = time.time()
            return
        self.n += 1
        ids_file = self.workdir / f"ids-{self.n}.txt"
        ids_file.write_text("\n".join(rest) + "\n")
        t.events_path, t.events_pos, t.current = str(self.workdir / f"events-{self.n}.jsonl"), 0, None
        Path(t.events_path).write_text("")
        t.out_path = str(self.workdir / f"out-{self.n}.txt")
        env = dict(self.base_env, **t.env, EXLA_RS_WATCH_IDS=str(ids_file), EXLA_RS_WATCH_EVENTS=t.events_path)
        cmd = t.prefix + [self.python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "gpu_watch", TEST_FILE]
        with open(t.out_path, "w") as out:
            t.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        t.first_start = t.first_start or time.time()

    def poll_events(self, t: Task):
        with open(t.events_path) as f:
            f.seek(t.events_pos)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        t.events_pos += len(complete)
        for line in complete.splitlines():
            e = json.loads(line)
            if e["ev"] == "start":
                t.current = (e["id"], e["t"], e.get("params", ""))
            else:
                params = t.current[2] if t.current and t.current[0] == e["id"] else ""
                t.results[e["id"]] = (e["outcome"], e["dur"], e.get("msg", ""), params)
                t.current = None

    def kill(self, t: Task):
        if t.proc is not None and t.proc.poll() is None:
            try:
                os.killpg(t.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            t.proc.wait()

    def collect_output(self, t: Task, note: str = ""):
        text = Path(t.out_path).read_text(errors="replace") if t.out_path and Path(t.out_path).exists() else ""
        t.output.append(f"----- {t.step} {t.label} (run {t.restarts + 1}){note}\n{text}")

    def step(self, t: Task):
        """Advances one running task; returns True while it still runs."""
        self.poll_events(t)
        now = time.time()
        if t.proc.poll() is None:
            if t.current and now - t.current[1] > t.test_deadline:
                tid, t0, params = t.current
                self.kill(t)
                self.poll_events(t)
                t.results.setdefault(tid, ("hung", now - t0, f"no return after {t.test_deadline:.0f} s; process group killed", params))
                self.collect_output(t, f": HUNG in {tid}")
                self.restart(t)
            return not t.done
        self.poll_events(t)
        rc = t.proc.returncode
        if t.current is not None:  # died inside a test
            tid, t0, params = t.current
            if t.prefix and tid not in t.retried:
                # compute-sanitizer itself segfaults now and then (H200, 2026-11-27: 27 of 60
                # memcheck tests, 0 errors reported before it): the test gets one more process.
                t.retried.add(tid)
                self.collect_output(t, f": CRASHED (exit {rc}) in {tid}, retried once")
            else:
                t.results.setdefault(tid, ("crashed", now - t0, f"the process died (exit {rc}) inside this test", params))
                self.collect_output(t, f": CRASHED (exit {rc}) in {tid}")
            self.restart(t)
            return not t.done
        self.collect_output(t, f": exit {rc}")
        t.exit_code = rc
        if t.remaining() and rc not in (0, 1):
            # Died between tests (collection error, a crash at exit): the rest are not run.
            for i in t.remaining():
                t.results[i] = ("not run", 0.0, f"the shard exited {rc} before it", "")
        t.done = True
        t.end_time = time.time()
        return False

    def restart(self, t: Task):
        t.restarts += 1
        t.proc = None
        self.start(t)

    def finish_unrun(self, t: Task, why: str):
        self.kill(t)
        if t.proc is not None:
            self.poll_events(t)
            if t.current:
                tid, t0, params = t.current
                # Not a hang: it had run less than its deadline when the phase ended.
                t.results.setdefault(tid, ("not run", time.time() - t0, f"in progress for {time.time() - t0:.0f} s at the {why}; killed", params))
            self.collect_output(t, f": killed at the {why}")
        for i in t.remaining():
            t.results[i] = ("not run", 0.0, why, "")
        t.done = True
        t.end_time = time.time()


def run_pool(runner, tasks, jobs, deadline):
    """Runs tasks, at most `jobs` at once, until all are done or `deadline` (epoch seconds)."""
    queue, running = list(tasks), []
    while queue or running:
        while queue and len(running) < jobs and time.time() < deadline:
            t = queue.pop(0)
            runner.start(t)
            if not t.done:
                running.append(t)
        running = [t for t in running if runner.step(t)]
        if time.time() >= deadline:
            for t in running + queue:
                runner.finish_unrun(t, "phase deadline")
            return
        time.sleep(0.2)


def collect_ids(python, env, select):
    r = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TEST_FILE] + (["-k", select] if select else []),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if not ids:
        raise SystemExit(f"collecting {TEST_FILE} found no tests (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return ids


def shards(ids, n):
    """n interleaved shards (neighbouring tests share shapes and kinds: spread them)."""
    return [s for s in (ids[i::n] for i in range(n)) if s]


def pieces(ids, size):
    return [ids[i:i + size] for i in range(0, len(ids), size)]


# One compute-sanitizer error: its first line and the `at` frame (kernel or API call) it names.
SAN_ERROR = re.compile(r"^========= (?!    |COMPUTE-SANITIZER|Target application|.*SUMMARY)(.+)$")
SAN_AT = re.compile(r"^=========\s+at (.+)$")
SAN_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")


def sanitizer_errors(text):
    """([(message, where)], reported total): the error blocks of a compute-sanitizer log."""
    errors, cur = [], None
    for line in text.splitlines():
        m = SAN_ERROR.match(line)
        if m:
            cur = [m.group(1).strip(), ""]
            errors.append(cur)
            continue
        a = SAN_AT.match(line)
        if a and cur is not None and not cur[1]:
            cur[1] = a.group(1).strip()
    total = sum(int(x) for x in SAN_SUMMARY.findall(text))
    return [tuple(e) for e in errors], total


def in_our_kernels(error) -> bool:
    """Whether a (message, where) error of sanitizer_errors() names one of our kernels."""
    return any("exla_rs" in part for part in error)


def env_report(args, python, env):
    lines = [f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, platform {args.platform}, host {os.uname().nodename}, "
             f"{os.cpu_count()} CPUs"]
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                           capture_output=True, text=True)
        lines.append(f"GPU: {r.stdout.strip() or r.stderr.strip()}")
    r = subprocess.run([python, "-c", "import jax, numpy; print('jax', jax.__version__, 'numpy', numpy.__version__, jax.devices())\n"
                        "try:\n import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())\nexcept Exception as e: print('torch: none')"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines += [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-4:]
    lib = Path(env.get("EXLA_RS_XLA_LIB", ""))
    if lib.is_file():
        import hashlib
        lines.append(f"library {lib} ({lib.stat().st_size} bytes, sha256 {hashlib.sha256(lib.read_bytes()).hexdigest()[:16]})")
    else:
        lines.append(f"library {lib}: MISSING")
    sanitizer = shutil.which("compute-sanitizer") or "none"
    lines.append(f"compute-sanitizer: {sanitizer}")
    git = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True, text=True).stdout.strip()
    lines.append(f"commit {git[:100] or '?'}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/exla_rs_gpu_out")
    ap.add_argument("--steps", default="env tests-mma tests-sm90 nvrtc sanitize bench")
    ap.add_argument("--jobs", type=int, default=0, help="processes side by side (default: the CPU count, at most 16)")
    ap.add_argument("--shards", type=int, default=0, help="test shards per path (default: 5/16 of jobs, at least 1: the other slots start the sanitizers)")
    ap.add_argument("--piece", type=int, default=6, help="tests per sanitizer process")
    ap.add_argument("-k", dest="select", default="", help="pytest -k selection of the tests steps")
    ap.add_argument("--test-deadline", type=float, default=30.0, help="seconds one test may run (sanitizers: x4, NVRTC: x3)")
    ap.add_argument("--phase-deadline", type=float, default=290.0, help="seconds for the tests and sanitizers together")
    ap.add_argument("--bench-deadline", type=float, default=130.0)
    ap.add_argument("--python", default=os.environ.get("PY") or sys.executable)
    ap.add_argument("--tools", default=" ".join(TOOLS), help="compute-sanitizer tools of the sanitize step")
    ap.add_argument("--sanitize-paths", default="mma sm90", help="kernel paths the sanitize step runs (a window that re-checks only new sm90 kernels: sm90)")
    ap.add_argument("--references", choices=("device", "host", "split"), default="host",
                    help="float64 references in numpy (BLAS einsums; measured 4x faster per test than jitted on the GPU, "
                         "whose per-shape XLA compile dominates), on the GPU, or split (mma: GPU, sm90: numpy) to compare")
    a = ap.parse_args()
    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in ("summary.txt", "tests.log", "sanitize.log", "bench.log", "bench.md", "results.jsonl"):
        (out / old).unlink(missing_ok=True)
    steps = a.steps.split()
    jobs = a.jobs or min(16, os.cpu_count() or 2)
    nshards = a.shards or max(1, jobs * 5 // 16)
    gpu = a.platform == "cuda"

    bench_env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false", EXLA_RS_TEST_PLATFORM=a.platform)
    bench_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "test/gpu"), str(ROOT / "test/xla")] + ([bench_env["PYTHONPATH"]] if bench_env.get("PYTHONPATH") else []))
    bench_env.setdefault("EXLA_RS_XLA_LIB", str(ROOT / "native/exla_rs/target/release/libexla_rs_xla.so"))
    env = dict(bench_env)
    workdir = tempfile.mkdtemp(prefix="exla_rs_gpu_checks_")
    if gpu:
        # The tests' children (not the benchmark: its peers keep XLA's defaults) share one
        # persistent compilation cache: both paths and every shard compile the same programs (the
        # path is read at run time). No autotuning: the tests time nothing.
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(workdir, "jax-cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    runner = Runner(a.python, env, workdir)
    not_ours, fails, env_lines, step_lines = [], [], [], []
    totals = Counter()

    if "env" in steps:
        env_lines = env_report(a, a.python, env)
        for ln in env_lines:
            log(ln)

    tasks_by_step = {}
    need_tests = [s for s in ("tests-mma", "tests-sm90") if s in steps]
    ids = collect_ids(a.python, env, a.select) if (need_tests or "sanitize" in steps or "nvrtc" in steps) else []
    log(f"{len(ids)} tests collected; jobs {jobs}, {nshards} shards per path")
    for s in need_tests:
        if s == "tests-sm90" and not gpu:
            step_lines.append((s, "skipped (GPU-only: EXLA_RS_CUDA_PATH has no effect on the Host handlers)"))
            continue
        path = s.split("-")[1]
        ref = {"device": "device", "host": "host", "split": "device" if path == "mma" else "host"}[a.references]
        tasks_by_step[s] = [Task(s, f"shard {i + 1}/{nshards}", sh, {"EXLA_RS_CUDA_PATH": path, "EXLA_RS_TEST_REF": ref}, [], a.test_deadline)
                            for i, sh in enumerate(shards(ids, nshards))]
    if "nvrtc" in steps:
        # The run-time compile path: a library built without nvcc (EXLA_RS_CUDA_NVCC=0) compiles its
        # kernels with NVRTC at first use; a few cases per dtype show it works.
        nvrtc_lib = Path(os.environ.get("EXLA_RS_XLA_LIB_NVRTC", ROOT / ".gpu/libexla_rs_xla_nvrtc.so"))
        libnvrtc = next((str(c) for c in [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64/libnvrtc.so.13",
                                          Path("/usr/local/cuda/lib64/libnvrtc.so.13")] if c.is_file()), "")
        if not gpu or not nvrtc_lib.is_file() or not libnvrtc:
            step_lines.append(("nvrtc", "skipped (" + ("GPU-only" if not gpu else f"no {nvrtc_lib}" if not nvrtc_lib.is_file() else "no libnvrtc.so.13") + ")"))
        else:
            sel = [i for i in ids if NVRTC_SELECT.search(i)]
            tasks_by_step["nvrtc"] = [Task("nvrtc", f"shard {n + 1}", sh, {"EXLA_RS_XLA_LIB": str(nvrtc_lib), "EXLA_RS_NVRTC": libnvrtc}, [], 3 * a.test_deadline)
                                      for n, sh in enumerate(shards(sel, 2))]
    if "sanitize" in steps:
        if not gpu or not shutil.which("compute-sanitizer"):
            step_lines.append(("sanitize", "skipped (GPU-only)" if not gpu else "skipped: compute-sanitizer not on PATH"))
        else:
            for path, pat in (("mma", SANITIZE_MMA), ("sm90", SANITIZE_SM90)):
                if path not in a.sanitize_paths.split():
                    continue
                sel = [i for i in ids if pat.search(i)]
                for tool in a.tools.split():
                    prefix = ["compute-sanitizer", "--tool", tool, "--kernel-name", "kns=exla_rs", "--print-limit", "20", "--error-exitcode", "99"]
                    s = f"{tool}-{path}"
                    # No pool allocator: every XLA buffer its own allocation, so memcheck sees exact bounds.
                    # No CUDA graphs (XLA's command buffers): our kernels run as plain launches the tools follow.
                    xla_flags = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
                    tasks_by_step[s] = [Task(s, f"piece {n + 1}", p, {"EXLA_RS_CUDA_PATH": path, "XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_FLAGS": xla_flags},
                                             prefix, 4 * a.test_deadline) for n, p in enumerate(pieces(sel, a.piece))]
                    if not sel:
                        step_lines.append((s, "no tests matched the sanitizer selection"))
    all_tasks = [t for ts in tasks_by_step.values() for t in ts]
    # Interleave the two paths' shards so both make progress; sanitizer pieces after them.
    test_tasks = [t for t in all_tasks if t.step.startswith("tests-")]
    san_tasks = [t for t in all_tasks if t.step.split("-")[0] in TOOLS]
    other_tasks = [t for t in all_tasks if t not in test_tasks and t not in san_tasks]
    # Sanitizer pieces round-robin over the (tool, path) pairs, so each tool makes progress; the
    # test shards (and NVRTC's) take 3/4 of the slots at first, the sanitizers start in the rest.
    by_step = {}
    for t in san_tasks:
        by_step.setdefault(t.step, []).append(t)
    san_order = [t for n in range(max(map(len, by_step.values()), default=0)) for ts in by_step.values() if n < len(ts) for t in [ts[n]]]
    tests_order = sorted(test_tasks, key=lambda t: (int(t.label.split()[1].split("/")[0]), t.step)) + other_tasks
    order = tests_order + san_order
    phase_t0 = time.time()
    if order:
        run_pool(runner, order, jobs, phase_t0 + a.phase_deadline)
    phase_wall = time.time() - phase_t0

    for s, ts in tasks_by_step.items():
        c = Counter()
        for t in ts:
            for i in t.ids:
                outcome, dur, msg, params = t.results.get(i, ("not run", 0.0, "never started", ""))
                c[outcome] += 1
                if outcome in ("failed", "error", "hung", "crashed"):
                    tag = {"failed": "FAILED", "error": "ERROR", "hung": "HUNG", "crashed": "CRASHED"}[outcome]
                    path = t.env.get("EXLA_RS_CUDA_PATH", "")
                    fails.append(f"{tag}: {i} [{s}, EXLA_RS_CUDA_PATH={path}] {msg}" + (f" ({params})" if params and outcome in ("hung", "crashed") else ""))
        started = [t.first_start for t in ts if t.first_start]
        wall = (max(t.end_time or time.time() for t in ts) - min(started)) if started else 0.0
        counts = ", ".join(f"{c[o]} {o}" for o in OUTCOMES if c[o])
        extra = ""
        if s.split("-")[0] in TOOLS:
            text = "".join("".join(t.output) for t in ts)
            errs, total = sanitizer_errors(text)
            ours = [e for e in errs if in_our_kernels(e)]
            others = len(errs) - len(ours)
            extra = f"; sanitizer: {total} errors reported, {len(ours)} in exla_rs kernels" + (f", {others} elsewhere (XLA/jax copies, not instrumented kernels)" if others else "")
            for msg, where in ours[:10]:
                fails.append(f"SANITIZER {s}: {msg} at {where}")
            if others:
                seen = Counter(f"{m} at {w}" for m, w in errs if (m, w) not in ours)
                for k, v in seen.most_common(3):
                    not_ours.append(f"  {s}: not ours, x{v}: {k}")
            c["failed"] += 1 if ours else 0
        step_lines.append((s, f"{counts}{extra}; {wall:.0f} s"))
        totals["passed"] += c["passed"]
        totals["failed"] += c["failed"] + c["error"] + c["hung"] + c["crashed"]
        totals["not run"] += c["not run"]

    # Every test's outcome and time, one JSON line each (what the summary counts).
    with open(out / "results.jsonl", "w") as f:
        for t in all_tasks:
            for i in t.ids:
                o, d, msg, params = t.results.get(i, ("not run", 0.0, "never started", ""))
                f.write(json.dumps({"step": t.step, "id": i, "outcome": o, "s": round(d, 2), "msg": msg[:300],
                                    "ref": t.env.get("EXLA_RS_TEST_REF", "")}) + "\n")
    with open(out / "tests.log", "w") as f:
        for t in test_tasks + other_tasks:
            f.write("".join(t.output))
    if san_tasks:
        with open(out / "sanitize.log", "w") as f:
            for t in san_tasks:
                f.write("".join(t.output))

    bench_lines = []
    if "bench" in steps:
        bench_md = out / "bench.md"
        if gpu:
            cmd = [a.python, "bench/bench_cuda.py", "--quick", "--results", str(bench_md), "--deadline", str(max(30, a.bench_deadline - 30))]
        else:
            cmd = [a.python, "bench/bench_cuda.py", "--selftest"]
        t0 = time.time()
        with open(out / "bench.log", "w") as f:
            p = subprocess.Popen(cmd, cwd=ROOT, env=bench_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=a.bench_deadline)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = "killed at its deadline"
        ok = rc == 0
        # Exit 3: bench_cuda.py's watchdog wrote the rows it had when one measurement did not return.
        state = "ok" if ok else "PARTIAL (a measurement did not return; rows so far written)" if rc == 3 and bench_md.exists() else f"FAILED (exit {rc})"
        step_lines.append(("bench", f"{state} in {time.time() - t0:.0f} s" + ("" if gpu else " (--selftest: no GPU)")))
        totals["passed" if ok else "failed"] += 1
        if bench_md.exists():
            bench_lines = bench_md.read_text().splitlines()
        elif not gpu:
            bench_lines = []

    wall = time.time() - t_start
    lines = ["# exla_rs GPU check (test/gpu/run_gpu_checks.sh)", ""] + env_lines + [""]
    lines.append(f"tests + sanitizers phase: {phase_wall:.0f} s wall (deadline {a.phase_deadline:.0f} s, {jobs} jobs); whole run {wall:.0f} s")
    rank = lambda s: next((n for n, k in enumerate(("tests-mma", "tests-sm90", "nvrtc", "sanitize") + tuple(f"{x}-{p}" for p in ("mma", "sm90") for x in TOOLS) + ("bench",)) if k == s), 99)
    lines += [f"{s:16s} {txt}" for s, txt in sorted(step_lines, key=lambda st: rank(st[0]))]
    per_test = []
    for t in all_tasks:
        for i, (o, d, _, _) in t.results.items():
            if o in ("passed", "failed"):
                per_test.append((d, t.step, i))
    if per_test:
        per_test.sort(reverse=True)
        lines += ["", "slowest tests:"] + [f"  {d:6.1f} s {s} {i}" for d, s, i in per_test[:5]]
    if fails:
        lines += [""] + fails[:200] + ([f"... {len(fails) - 200} more"] if len(fails) > 200 else [])
    if not_ours:
        lines += ["", "sanitizer reports outside our kernels:"] + not_ours
    if bench_lines:
        lines += ["", "benchmark (bench/bench_cuda.py --quick):"] + bench_lines
    if totals["not run"]:
        lines.append(f"\n{totals['not run']} tests not run (deadlines)")
    lines += ["", f"{totals['passed']} passed, {totals['failed']} failed"]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if totals["failed"] == 0 and totals["not run"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
