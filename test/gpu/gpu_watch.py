"""pytest plugin of the GPU check (gpu_checks.py), loaded with `-p gpu_watch` in each child pytest.

- EXLA_RS_WATCH_IDS=FILE: runs only the test ids listed there (one per line, in that order), so the
  supervisor can hand a shard its tests and restart it after a hung or crashed test with the rest.
- EXLA_RS_WATCH_EVENTS=FILE: appends one JSON line when a test starts and one when it ends (its
  outcome, duration, failure message and the case's parameters), flushed at once: the supervisor
  reads them to know which test is running and for how long, even when the process never returns.
- EXLA_RS_TEST_HANG=SUBSTRING: a test whose id contains it never returns, ignoring SIGINT and
  SIGTERM as a hung CUDA kernel does (the process must be killed): the `--platform cpu` plumbing
  check and its test inject the hang this way. Never set on a real run.
"""
import json
import os
import signal
import time

import pytest

_EVENTS = os.environ.get("EXLA_RS_WATCH_EVENTS")
_reports = {}


def _emit(record):
    if not _EVENTS:
        return
    with open(_EVENTS, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _params(item):
    """The test's parameters in a line (a Case names its shape and options)."""
    cs = getattr(item, "callspec", None)
    if cs is None:
        return ""
    return ", ".join(f"{k}={v!r}" for k, v in cs.params.items())[:400]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get("EXLA_RS_WATCH_IDS")
    if not path:
        return
    order = {line.strip(): n for n, line in enumerate(open(path)) if line.strip()}
    keep = sorted((i for i in items if i.nodeid in order), key=lambda i: order[i.nodeid])
    drop = [i for i in items if i.nodeid not in order]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_logstart(nodeid, location):
    _reports[nodeid] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _emit({"ev": "start", "id": item.nodeid, "params": _params(item), "t": time.time(), "pid": os.getpid()})


def pytest_runtest_call(item):
    hang = os.environ.get("EXLA_RS_TEST_HANG")
    if hang and hang in item.nodeid:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        while True:
            time.sleep(3600)


def pytest_runtest_logreport(report):
    _reports.setdefault(report.nodeid, []).append(report)


def pytest_runtest_logfinish(nodeid, location):
    reps = _reports.pop(nodeid, [])
    outcome, message, duration = "passed", "", 0.0
    for r in reps:
        duration += r.duration
        if r.failed:
            outcome = "failed" if r.when == "call" else "error"
            text = r.longreprtext or ""
            # The assertion's own line(s): pytest marks them with "E   ".
            lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
            message = " | ".join(lines[:3])[:500] or text.strip().splitlines()[-1][:500] if text.strip() else ""
            break
        if r.skipped and outcome == "passed":
            outcome = "skipped"
    _emit({"ev": "end", "id": nodeid, "outcome": outcome, "dur": round(duration, 3), "msg": message, "t": time.time()})
