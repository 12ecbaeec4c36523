"""A pytest plugin that logs each test's cost, to choose what to cut when the suite nears its
20-minute budget (``make durations``; ``-p tests.durations`` on any pytest line).

One TSV row per test phase (setup, call, teardown): node id, phase, wall seconds, CPU seconds
(of the pytest process and of its children: the sandbox's ONNX Runtime, the optimizer's pass
runners), outcome, the xdist worker and the time it ended. Wall seconds of a
parallel run include waiting for the other workers' CPU; CPU seconds do not, so rank by them
when the machine is shared. Written by the xdist controller (or the only process) to
``$ONNXMEDIC_DURATIONS`` (default build/durations.tsv); the terminal summary lists the
costliest tests and files.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

DEFAULT_PATH = "build/durations.tsv"
_START = "_onnxmedic_cpu_start"
TOP = 25


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + _live_children()


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _live_children() -> float:
    """CPU seconds of the children alive now (and of the children they waited for): the kept
    sandbox child (conftest's keep_warm) serves many tests before it is waited for, when its
    seconds move into RUSAGE_CHILDREN - a difference of _cpu() counts each second once."""
    total = 0
    try:
        me = os.getpid()
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children") as fh:
                for pid in fh.read().split():
                    try:
                        with open(f"/proc/{pid}/stat") as st:
                            fields = st.read().rsplit(")", 1)[1].split()
                    except OSError:  # gone meanwhile
                        continue
                    total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    except OSError:  # no /proc: waited-for children only
        return 0.0
    return total / _TICK


def _mark_start(item: pytest.Item) -> None:
    setattr(item, _START, _cpu())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _mark_start(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    _mark_start(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _mark_start(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any):
    outcome = yield
    report = outcome.get_result()
    start = getattr(item, _START, None)
    if start is not None:  # user_properties travel from an xdist worker to the controller
        report.user_properties.append((f"cpu_s:{call.when}", round(_cpu() - start, 3)))


class _Log:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = path.open("w", buffering=1)
        self.file.write("nodeid\tphase\twall_s\tcpu_s\toutcome\tworker\tended\n")
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def add(self, report: pytest.TestReport) -> None:
        cpu = dict(report.user_properties).get(f"cpu_s:{report.when}", float("nan"))
        worker = getattr(report, "node", None)
        worker = getattr(worker, "gateway", None)
        self.file.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{cpu:.3f}\t"
                        f"{report.outcome}\t{getattr(worker, 'id', '-')}\t{time.time():.0f}\n")
        self.wall[report.nodeid] += report.duration
        if cpu == cpu:  # not NaN
            self.cpu[report.nodeid] += cpu


_LOG: list[_Log] = []  # the controller's log (or the only process's)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes the log
        return
    _LOG[:] = [_Log(Path(os.environ.get("ONNXMEDIC_DURATIONS", DEFAULT_PATH)))]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _LOG:
        _LOG[0].add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _LOG:
        return
    log = _LOG.pop()
    log.file.close()
    tw = terminalreporter
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, wall in log.wall.items():
        row = by_file[nodeid.split("::")[0]]
        row[0] += wall
        row[1] += log.cpu.get(nodeid, 0.0)
        row[2] += 1
    tw.section(f"durations (all phases of each test; log: {log.path})")
    tw.line(f"{len(log.wall)} tests, {sum(log.wall.values()):.0f} s wall, "
            f"{sum(log.cpu.values()):.0f} s CPU in all")
    tw.line(f"the {TOP} costliest tests (CPU s, wall s):")
    for nodeid in sorted(log.wall, key=lambda n: -log.cpu.get(n, log.wall[n]))[:TOP]:
        tw.line(f"  {log.cpu.get(nodeid, float('nan')):7.1f} {log.wall[nodeid]:7.1f}  {nodeid}")
    tw.line(f"the {TOP} costliest files (CPU s, wall s, tests):")
    for name, (wall, cpu, n) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:TOP]:
        tw.line(f"  {cpu:7.1f} {wall:7.1f} {int(n):5d}  {name}")
