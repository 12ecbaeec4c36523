"""``onnxmedic sweep ZOO``: run every entry of a model zoo through the pipeline.

A zoo is a Python file, an importable module or a folder of such files, each exposing ``ZOO``:
a dict name -> factory. A factory takes no argument and returns a :class:`ZooCase` (or a tuple
``(model, args[, kwargs[, dynamic_shapes]])``). Every entry runs in its own worker process
(``python -m onnxmedic._sweep_worker``) in its own process group, with a timeout: a crash or a
hang of one entry is recorded as a finding and never stops the sweep. Results are written to
the results file atomically after each entry, so ``resume=True`` carries on where a sweep that
was itself killed stopped. ``executor="ray"`` runs the same worker as Ray tasks.
"""

from __future__ import annotations

import importlib
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.findings import Finding, InputError, ResultCodes, Severity, error, info

logger = logging.getLogger(__name__)

RESULTS_FORMAT = "onnxmedic-sweep/1"
_LIVE: set[subprocess.Popen[bytes]] = set()  # running workers, killed if the sweep is stopped
_LIVE_LOCK = threading.Lock()
DEFAULT_TIMEOUT = 600.0
STATUSES = ("verified", "failed", "factory-failed", "crashed", "timeout")


@dataclass
class ZooCase:
    """What a zoo factory returns: the model, its example inputs and dynamic shapes.

    ``check``, when given, is called in the worker as ``check(onnx_path, case)`` after a
    verified export and returns a dict with ``ok`` (bool) and its figures - e.g. a comparison
    over a few greedy decoding steps. ``note`` is shown in the summary.
    """

    model: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    dynamic_shapes: Any = None
    note: str = ""
    check: Callable[[str, ZooCase], dict[str, Any]] | None = None
    tolerance: tuple[float, float] | None = None


def as_case(value: Any, name: str = "?") -> ZooCase:
    """Normalise what a factory returned into a ZooCase; TypeError when it is neither."""
    if isinstance(value, ZooCase):
        return value
    if isinstance(value, tuple) and 2 <= len(value) <= 4:
        model, args, *rest = value
        kwargs = rest[0] if rest else {}
        dyn = rest[1] if len(rest) > 1 else None
        if isinstance(args, list):
            args = tuple(args)
        elif not isinstance(args, tuple):
            args = (args,)
        return ZooCase(model, args, kwargs or {}, dyn)
    raise TypeError(f"zoo entry {name!r}: the factory returned {type(value).__name__}; it must "
                    "return a ZooCase or a tuple (model, args[, kwargs[, dynamic_shapes]])")


@dataclass(frozen=True)
class Entry:
    """One zoo entry: its name and where the worker imports it from (``source:attr``)."""

    name: str
    source: str
    attr: str = "ZOO"


def _zoo_err(message: str, suggestion: str | None = None) -> InputError:
    return InputError(error("OM704", "zoo", message, suggestion=suggestion or
                            "A zoo is a .py file, an importable module or a folder of .py "
                            "files, each defining ZOO = {name: factory}."))


def import_source(source: str) -> Any:
    """Import a zoo source: a .py path or a dotted module name."""
    if source.endswith(".py") or os.sep in source:
        from onnxmedic.inputs import import_file

        return import_file(source)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(source)


def _zoo_dict(source: str, attr: str) -> dict[str, Any]:
    try:
        mod = import_source(source)
    except InputError:
        raise
    except Exception as e:
        raise _zoo_err(f"cannot import the zoo {source!r}: {type(e).__name__}: {e}") from e
    zoo = getattr(mod, attr, None)
    if not isinstance(zoo, dict):
        raise _zoo_err(f"{source!r} has no dict named {attr} "
                       f"({'it is a ' + type(zoo).__name__ if zoo is not None else 'missing'}).")
    return zoo


def load_zoo(spec: str | os.PathLike[str]) -> list[Entry]:
    """The entries of a zoo spec: ``file.py``, ``pkg.module``, either with ``:ATTR`` (default
    ``ZOO``), or a folder (every ``*.py`` not starting with ``_``). Raises InputError (OM704)."""
    spec = str(spec)
    path_part, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "ZOO")
    attr = attr or "ZOO"
    p = Path(path_part)
    if p.is_dir():
        sources = sorted(str(f) for f in p.glob("*.py") if not f.name.startswith("_"))
        if not sources:
            raise _zoo_err(f"the folder {path_part!r} holds no .py zoo files.")
    elif path_part.endswith(".py") and not p.is_file():
        raise _zoo_err(f"the zoo file {path_part!r} does not exist.")
    else:
        sources = [str(p.resolve()) if p.is_file() else path_part]
    entries: dict[str, Entry] = {}
    for src in sources:
        zoo = _zoo_dict(src, attr)
        for name, factory in zoo.items():
            if not callable(factory):
                raise _zoo_err(f"zoo entry {name!r} in {src} is a {type(factory).__name__}, "
                               "not a factory (a function returning the model and inputs).")
            if name in entries:
                raise _zoo_err(f"zoo entry {name!r} is defined twice ({entries[name].source} "
                               f"and {src}).")
            entries[str(name)] = Entry(str(name), src, attr)
    if not entries:
        raise _zoo_err(f"the zoo {spec!r} has no entries ({attr} is empty).")
    return list(entries.values())


# --------------------------------------------------------------------------------------------
# one entry, in its own process


@dataclass
class _Options:
    timeout: float
    verify: bool = True
    out_dir: str | None = None
    threads: int | None = None
    pythonpath: str = ""


def _env(opts: _Options) -> dict[str, str]:
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


def run_entry(entry: Entry, opts: _Options) -> dict[str, Any]:
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
            proc = subprocess.Popen([sys.executable, "-m", "onnxmedic._sweep_worker",
                                     json.dumps(payload)], stdin=subprocess.DEVNULL,
                                    stdout=fh, stderr=subprocess.STDOUT, env=_env(opts),
                                    start_new_session=True)
            with _LIVE_LOCK:
                _LIVE.add(proc)
            try:
                rc = proc.wait(timeout=opts.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return _record(entry, "timeout", time.perf_counter() - t0, findings=[error(
                    "OM702", "sweep", f"{entry.name}: did not finish within {opts.timeout:g} s; "
                    "the worker and its children were killed.",
                    suggestion="Raise --timeout, or run this entry alone with `onnxmedic "
                    "export` to see where it hangs.", details={"log": _tail(log)})])
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
                with _LIVE_LOCK:
                    _LIVE.discard(proc)
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
        return _record(entry, "crashed", seconds, findings=[error(
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


def _record(entry: Entry, status: str, seconds: float, *, findings: list[Finding] | None = None,
            **extra: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "name": entry.name, "source": entry.source, "status": status,
        "ok": status == "verified", "stages": {}, "failed_stage": None,
        "findings": [f.to_dict() for f in findings or []], "max_abs": None, "max_rel": None,
        "export_seconds": None, "seconds": round(seconds, 3), "peak_rss_mb": None,
        "note": "", "check": None, "opset": None,
    }
    rec.update(extra)
    return rec


# --------------------------------------------------------------------------------------------
# the sweep


@dataclass
class SweepResult(ResultCodes):
    """The outcome of sweep(): one record per entry (dicts, as in the results file)."""

    zoo: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    executor: str = "local"
    jobs: int = 1
    seconds: float = 0.0
    results_path: str | None = None
    command: str = "sweep"

    @property
    def ok(self) -> bool:
        return all(e["ok"] for e in self.entries) and not self.errors and bool(self.entries)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for e in self.entries:
            out[e["status"]] = out.get(e["status"], 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": RESULTS_FORMAT, "command": self.command, "zoo": self.zoo,
                "ok": self.ok, "exit_code": self.exit_code, "executor": self.executor,
                "jobs": self.jobs, "seconds": round(self.seconds, 3),
                "results_path": self.results_path, "counts": self.counts(),
                "findings": [f.to_dict() for f in self.findings], "entries": self.entries}


def _read_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("format") != RESULTS_FORMAT or not isinstance(data.get("entries"), list):
            raise ValueError(f"not an onnxmedic sweep results file (format "
                             f"{data.get('format')!r})")
        return [e for e in data["entries"] if isinstance(e, dict) and "name" in e]
    except (ValueError, OSError, AttributeError) as e:
        raise InputError(error("OM706", "sweep", f"cannot resume from {str(path)!r}: {e}",
                               suggestion="Give the results file a previous `onnxmedic sweep "
                               "--results` wrote, or start afresh without --resume.")) from e


def _write_results(result: SweepResult) -> None:
    if result.results_path is None:
        return
    from onnxmedic.report.files import atomic_write_text

    atomic_write_text(result.results_path, json.dumps(result.to_dict(), indent=1, default=str))


def _summarise(result: SweepResult) -> None:
    """One finding per entry that is not verified, and the summary line (OM708)."""
    for e in result.entries:
        if e["ok"]:
            continue
        own = [f for f in e["findings"] if f["severity"] == "error"]
        if e["status"] in ("crashed", "timeout", "factory-failed") and own:
            f = own[0]
            result.findings.append(Finding(f["code"], f["stage"], Severity.ERROR, f["message"],
                                           suggestion=f.get("suggestion"),
                                           details={"entry": e["name"]}))
            continue
        first = own[0] if own else None
        why = (f"{first['code']} {first['title']}: {first['message']}" if first
               else "no error finding recorded")
        result.findings.append(error(
            "OM700", "sweep", f"{e['name']}: not verified (stage {e.get('failed_stage') or '?'}"
            f"): {why[:400]}", suggestion="Run it alone for the full report: its findings "
            "are in the sweep's JSON report under entries.", details={"entry": e["name"]}))
    c = result.counts()
    result.findings.append(info(
        "OM708", "sweep", f"{c['verified']} of {len(result.entries)} entries exported and "
        f"verified; {c['failed']} failed, {c['factory-failed']} could not be built, "
        f"{c['crashed']} crashed, {c['timeout']} timed out ({result.seconds:.1f} s, "
        f"{result.jobs} job(s), executor {result.executor})."))


def sweep(
    zoo: str | os.PathLike[str],
    *,
    jobs: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    results: str | os.PathLike[str] | None = None,
    resume: bool = False,
    executor: str = "local",
    ray_address: str | None = None,
    names: list[str] | None = None,
    verify: bool = True,
    out_dir: str | os.PathLike[str] | None = None,
    report: str | os.PathLike[str] | None = None,
    progress: bool = False,
    on_entry: Callable[[dict[str, Any]], None] | None = None,
) -> SweepResult:
    """Run every entry of ``zoo`` through export + verify, each in its own worker process.

    ``jobs``: entries at a time (default: CPU cores). ``timeout``: seconds per entry, after
    which the worker's process group is killed (OM702); a worker that dies is OM701.
    ``results``: a JSON file rewritten atomically after each entry; with ``resume=True`` the
    entries already in it are skipped. ``executor``: "local" (processes here) or "ray" (Ray
    tasks; ``ray_address`` of a running cluster, else a local instance). ``names``: run only
    these entries. ``out_dir``: keep each verified model there as NAME.onnx. ``report``: a
    .json or .html summary. Problems are findings of the returned SweepResult; it does not
    raise for them.
    """
    if executor not in ("local", "ray"):
        raise ValueError(f"onnxmedic.sweep: executor must be 'local' or 'ray', not {executor!r}")
    jobs = max(1, int(jobs or os.cpu_count() or 1))
    result = SweepResult(zoo=str(zoo), executor=executor, jobs=jobs,
                         results_path=str(results) if results is not None else None)
    t0 = time.perf_counter()
    from onnxmedic.onnxfile import check_output_path

    bad = check_output_path(results, stage="sweep") if results is not None else None
    if bad is not None:
        result.findings.append(bad)
        result.results_path = None
        return result
    try:
        _sweep(result, zoo, jobs, timeout, resume, executor, ray_address, names, verify,
               out_dir, progress, on_entry)
    except InputError as e:
        result.findings.append(e.finding)
    result.seconds = time.perf_counter() - t0
    if result.entries:
        _summarise(result)
    _write_results(result)
    if report is not None:
        write_sweep_report(result, report)
    return result


def _sweep(result: SweepResult, zoo: Any, jobs: int, timeout: float, resume: bool,
           executor: str, ray_address: str | None, names: list[str] | None, verify: bool,
           out_dir: Any, progress: bool, on_entry: Callable[[dict[str, Any]], None] | None
           ) -> None:
    if resume and result.results_path is None:
        raise ValueError("onnxmedic.sweep: resume=True needs results= (the file to resume)")
    entries = load_zoo(zoo)
    if names:
        known = {e.name for e in entries}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise _zoo_err(f"no zoo entry named {', '.join(unknown)}; the zoo has "
                           f"{', '.join(sorted(known))}.")
        entries = [e for e in entries if e.name in names]
    if resume:
        done = {e["name"]: e for e in _read_results(Path(result.results_path or ""))}
        kept = [done[e.name] for e in entries if e.name in done]
        result.entries.extend(kept)
        entries = [e for e in entries if e.name not in done]
        result.findings.append(info("OM707", "sweep", f"resumed from {result.results_path}: "
                                    f"{len(kept)} entries already done were skipped, "
                                    f"{len(entries)} to run."))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    pkg_root = str(Path(__file__).resolve().parents[1])
    cores = os.cpu_count() or 1
    opts = _Options(timeout=timeout, verify=verify,
                    out_dir=str(Path(out_dir).resolve()) if out_dir is not None else None,
                    threads=max(1, cores // min(jobs, max(1, len(entries)))),
                    pythonpath=pkg_root)
    _write_results(result)
    if not entries:
        return
    run = _run_ray if executor == "ray" else _run_local
    with _progress(progress, len(entries)) as advance:
        for rec in run(entries, opts, jobs, ray_address):
            result.entries.append(rec)
            _write_results(result)
            advance(rec)
            if on_entry is not None:
                on_entry(rec)


def _run_local(entries: list[Entry], opts: _Options, jobs: int, _address: str | None
               ) -> Iterator[dict[str, Any]]:
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="sweep")
    futures = [pool.submit(run_entry, e, opts) for e in entries]
    try:
        for fut in as_completed(futures):
            yield fut.result()
    finally:  # also on Ctrl-C or an error here: no worker outlives the sweep
        for fut in futures:
            fut.cancel()
        with _LIVE_LOCK:
            live = list(_LIVE)
        for proc in live:
            _kill_group(proc)
        pool.shutdown(wait=True)


def ray_missing() -> Finding:
    """The finding for --executor ray without ray installed."""
    return error("OM705", "sweep", "--executor ray needs the `ray` package, which is not "
                 "installed in this Python.", suggestion="pip install 'onnxmedic[ray]' (or "
                 "`pip install ray`), or use --executor local.")


def _run_ray(entries: list[Entry], opts: _Options, jobs: int, address: str | None
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
                yield _record(entry, "crashed", 0.0, findings=[error(
                    "OM701", "sweep", f"{entry.name}: the Ray task failed: "
                    f"{type(e).__name__}: {str(e)[:300]}",
                    suggestion="Run this entry alone with `onnxmedic export`.")])
    finally:
        if started:
            ray.shutdown()


class _progress:
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


# --------------------------------------------------------------------------------------------
# reports


def summary_rows(result: SweepResult) -> list[dict[str, Any]]:
    """Per entry: the columns of the summary table."""
    rows = []
    for e in result.entries:
        codes = sorted({f["code"] for f in e["findings"] if f["severity"] != "info"})
        stages = e.get("stages") or {}
        rows.append({
            "name": e["name"], "status": e["status"], "ok": e["ok"],
            "stages": "".join("✔" if v == "passed" else "✘" if v == "failed" else "·"
                              for v in stages.values()),
            "failed_stage": e.get("failed_stage") or "",
            "findings": ", ".join(codes), "max_abs": e.get("max_abs"),
            "export_seconds": e.get("export_seconds"), "peak_rss_mb": e.get("peak_rss_mb"),
            "note": e.get("note") or "",
        })
    return rows


def render_sweep_terminal(result: SweepResult, console: Any = None) -> None:
    """The summary table on stderr: per model, stages, findings, max error, export seconds."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(stderr=True, soft_wrap=True)
    t = Table(title=f"onnxmedic sweep {escape(result.zoo)}", title_justify="left")
    for col in ("model", "status", "stages", "findings", "max abs err", "export s", "peak MiB"):
        t.add_column(col)
    for r in summary_rows(result):
        status = f"[green]{r['status']}[/]" if r["ok"] else f"[red]{r['status']}[/]"
        t.add_row(escape(r["name"]), status, r["stages"], escape(r["findings"]),
                  "" if r["max_abs"] is None else f"{r['max_abs']:.2g}",
                  "" if r["export_seconds"] is None else f"{r['export_seconds']:.1f}",
                  "" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}")
    if result.entries:
        console.print(t)
    for f in result.findings:
        if f.code == "OM700":
            continue  # in the table already
        color = {"error": "red", "warning": "yellow", "info": "blue"}[f.severity.value]
        console.print(f"[{color}]{f.code}[/] [bold]{escape(f.title)}[/]: {escape(f.message)}")
        if f.suggestion and f.severity == Severity.ERROR:
            console.print(f"    [cyan]Next step:[/] {escape(f.suggestion)}")


def write_sweep_report(result: SweepResult, path: str | os.PathLike[str]) -> None:
    """Write the sweep as .json or .html (by extension); failures become findings."""
    from onnxmedic.report.files import atomic_write_text, render_template

    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".html", ".htm"):
        result.findings.append(error("OM004", "report", f"report path {str(path)!r} must end "
                                     "in .json or .html."))
        return
    try:
        if suffix == ".json":
            text = json.dumps(result.to_dict(), indent=2, default=str)
        else:
            text = render_template("sweep.html.j2", r=result.to_dict(),
                                   rows=summary_rows(result))
        atomic_write_text(p, text)
    except OSError as e:
        result.findings.append(error("OM006", "report", f"cannot write the report "
                                     f"{str(path)!r}: {e.strerror or e}"))
