"""``onnxmedic sweep ZOO``: run every entry of a model zoo through the pipeline.

A zoo is a Python file, an importable module or a folder of such files, each exposing ``ZOO``:
a dict name -> factory. A factory takes no argument and returns a :class:`ZooCase` (or a tuple
``(model, args[, kwargs[, dynamic_shapes]])``). Every entry runs in its own worker process
(``python -m onnxmedic.sweep.worker``) in its own process group, with a timeout: a crash or a
hang of one entry is recorded as a finding and never stops the sweep. Results are written to
the results file atomically after each entry, so ``resume=True`` carries on where a sweep that
was itself killed stopped. ``executor="ray"`` runs the same worker as Ray tasks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onnxmedic.findings import InputError, info
from onnxmedic.onnxfile import check_output_path
from onnxmedic.report.sweep import render_sweep_terminal, summary_rows, write_sweep_report
from onnxmedic.sweep.executors import (
    Options,
    ProgressBar,
    ray_missing,
    run_entry,
    run_local,
    run_ray,
)
from onnxmedic.sweep.results import (
    RESULTS_FORMAT,
    STATUSES,
    SweepResult,
    read_results,
    record,
    summarise,
    write_results,
)
from onnxmedic.sweep.zoo import Entry, ZooCase, as_case, import_source, load_zoo, zoo_error

DEFAULT_TIMEOUT = 600.0

__all__ = ["DEFAULT_TIMEOUT", "RESULTS_FORMAT", "STATUSES", "Entry", "SweepResult", "ZooCase",
           "as_case", "import_source", "load_zoo", "ray_missing", "record",
           "render_sweep_terminal", "run_entry", "summary_rows", "sweep", "write_sweep_report"]


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
        summarise(result)
    write_results(result)
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
            raise zoo_error(f"no zoo entry named {', '.join(unknown)}; the zoo has "
                           f"{', '.join(sorted(known))}.")
        entries = [e for e in entries if e.name in names]
    if resume:
        done = {e["name"]: e for e in read_results(Path(result.results_path or ""))}
        kept = [done[e.name] for e in entries if e.name in done]
        result.entries.extend(kept)
        entries = [e for e in entries if e.name not in done]
        result.findings.append(info("OM707", "sweep", f"resumed from {result.results_path}: "
                                    f"{len(kept)} entries already done were skipped, "
                                    f"{len(entries)} to run."))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    pkg_root = str(Path(__file__).resolve().parents[2])
    cores = os.cpu_count() or 1
    opts = Options(timeout=timeout, verify=verify,
                    out_dir=str(Path(out_dir).resolve()) if out_dir is not None else None,
                    threads=max(1, cores // min(jobs, max(1, len(entries)))),
                    pythonpath=pkg_root)
    write_results(result)
    if not entries:
        return
    run = run_ray if executor == "ray" else run_local
    with ProgressBar(progress, len(entries)) as advance:
        for rec in run(entries, opts, jobs, ray_address):
            result.entries.append(rec)
            write_results(result)
            advance(rec)
            if on_entry is not None:
                on_entry(rec)
