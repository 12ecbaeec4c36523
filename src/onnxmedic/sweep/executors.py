"""Executors: each entry runs in its own worker process (``python -m onnxmedic.sweep.worker``)
in its own process group, with a timeout - locally (a thread per running entry) or as Ray
tasks. A crash or a hang of one entry is recorded as a finding and never stops the sweep."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxmedic.findings import Finding, InputError, error
from onnxmedic.sweep.results import record
from onnxmedic.sweep.zoo import Entry

logger = logging.getLogger(__name__)

LIVE_WORKERS: set[subprocess.Popen[bytes]] = set()  # running workers, killed if the sweep is stopped
_LIVE_LOCK = threading.Lock()
# set when a local sweep stops (Ctrl-C, an error): a worker started after the stop's sweep of
# LIVE_WORKERS (its Popen was returning) kills itself on registering instead of running to its timeout
STOPPING = threading.Event()


@dataclass
class Options:
    timeout: float
    verify: bool = True
    out_dir: str | None = None
    threads: int | None = None
    pythonpath: str = ""


def _env(opts: Options) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (opts.pythonpath, env.get("PYTHONPATH"))
                                        if x)
    if opts.threads and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(opts.threads)
    return env


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_entry(entry: Entry, opts: Options) -> dict[str, Any]:
    """Run one entry in a worker process (own session, killed with its group on timeout) and
    return its record. Never raises for the entry's own problems."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onnxmedic-sweep-") as td:
        out = Path(td) / "result.json"
        log = Path(td) / "worker.log"
        payload = {"source": entry.source, "attr": entry.attr, "name": entry.name,
                   "out": str(out), "verify": opts.verify, "out_dir": opts.out_dir,
                   "threads": opts.threads}
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "onnxmedic.sweep.worker",
                                     json.dumps(payload)], stdin=subprocess.DEVNULL,
                                    stdout=fh, stderr=subprocess.STDOUT, env=_env(opts),
                                    start_new_session=True)
            with _LIVE_LOCK:
                LIVE_WORKERS.add(proc)
                if STOPPING.is_set():
                    _kill_group(proc)
            try:
                rc = proc.wait(timeout=opts.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return record(entry, "timeout", time.perf_counter() - t0, findings=[error(
                    "OM702", "sweep", f"{entry.name}: did not finish within {opts.timeout:g} s; "
                    "the worker and its children were killed.",
                    suggestion="Raise --timeout, or run this entry alone with `onnxmedic "
                    "export` to see where it hangs.", details={"log": _tail(log)})])
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
                with _LIVE_LOCK:
                    LIVE_WORKERS.discard(proc)
        seconds = time.perf_counter() - t0
        if out.is_file():
            try:
                rec = json.loads(out.read_text())
                rec["seconds"] = round(seconds, 3)
                return rec
            except ValueError:
                pass
        how = (f"was killed by signal {signal.Signals(-rc).name}" if rc < 0
               else f"exited with status {rc}")
        return record(entry, "crashed", seconds, findings=[error(
            "OM701", "sweep", f"{entry.name}: the worker process {how} before writing its "
            "result (a crash in native code, or the process was killed).",
            suggestion="Run this entry alone with `onnxmedic export` to reproduce the crash; "
            "the worker's last output is in the details.",
            details={"returncode": rc, "log": _tail(log)})])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        logger.warning("worker %d did not die after SIGKILL", proc.pid)


def run_local(entries: list[Entry], opts: Options, jobs: int, _address: str | None
               ) -> Iterator[dict[str, Any]]:
    STOPPING.clear()
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="sweep")
    futures = [pool.submit(run_entry, e, opts) for e in entries]
    try:
        for fut in as_completed(futures):
            yield fut.result()
    finally:  # also on Ctrl-C or an error here: no worker outlives the sweep
        STOPPING.set()
        for fut in futures:
            fut.cancel()
        with _LIVE_LOCK:
            live = list(LIVE_WORKERS)
        for proc in live:
            _kill_group(proc)
        pool.shutdown(wait=True)


def ray_missing() -> Finding:
    """The finding for --executor ray without ray installed."""
    return error("OM705", "sweep", "--executor ray needs the `ray` package, which is not "
                 "installed in this Python.", suggestion="pip install 'onnxmedic[ray]' (or "
                 "`pip install ray`), or use --executor local.")


def run_ray(entries: list[Entry], opts: Options, jobs: int, address: str | None
             ) -> Iterator[dict[str, Any]]:
    try:
        import ray
    except ImportError as e:
        raise InputError(ray_missing()) from e
    started = False
    if not ray.is_initialized():
        try:
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": _env(opts)["PYTHONPATH"]}})
            started = True
        except Exception as e:
            raise InputError(error(
                "OM709", "sweep", f"cannot start or join the Ray cluster "
                f"({address or 'local instance'}): {type(e).__name__}: {e}",
                suggestion="Check the address (ray://HOST:10001 or auto) and that `ray status` "
                "works there, or use --executor local.")) from e
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(run_entry)
        pending = {task.remote(e, opts): e for e in entries}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            entry = pending.pop(done[0])
            try:
                yield ray.get(done[0])
            except Exception as e:  # the Ray worker itself died: same as a crashed entry
                yield record(entry, "crashed", 0.0, findings=[error(
                    "OM701", "sweep", f"{entry.name}: the Ray task failed: "
                    f"{type(e).__name__}: {str(e)[:300]}",
                    suggestion="Run this entry alone with `onnxmedic export`.")])
    finally:
        if started:
            ray.shutdown()


class ProgressBar:
    """A rich progress bar on stderr (or nothing); the context value advances it."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self.bar: Any = None

    def __enter__(self) -> Callable[[dict[str, Any]], None]:
        if not self.enabled:
            return lambda rec: None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.description}"),
                            console=Console(stderr=True), transient=False)
        self.bar.__enter__()
        task = self.bar.add_task("", total=self.total)
        counts = {"ok": 0, "bad": 0}

        def advance(rec: dict[str, Any]) -> None:
            counts["ok" if rec["ok"] else "bad"] += 1
            mark = "[green]✔[/]" if rec["ok"] else f"[red]✘ {rec['status']}[/]"
            self.bar.console.print(f"{mark} {rec['name']} ({rec.get('seconds') or 0:.1f} s)")
            self.bar.update(task, advance=1, description=f"{counts['ok']} verified, "
                            f"{counts['bad']} not")

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
