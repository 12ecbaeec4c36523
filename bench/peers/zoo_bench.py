"""The zoo benchmark: plain torch.onnx.export(dynamo=True) against onnxmedic, one table.

For every entry of a zoo (default: bench/zoo/hf.py:ALL), each tool in a fresh worker process of
its own with a timeout (the same isolation as `onnxmedic sweep`), after the same warm-up (both
tools export and verify a tiny conv net: imports and one-time set-up are paid before timing):

- torch.onnx: ``torch.onnx.export(..., dynamic_shapes=..., dynamo=True, verify=True)``, then the
  model is run in ONNX Runtime at the example and at each dynamic dimension's size 1 and 2x and
  compared with PyTorch (onnxmedic's tolerances) - "exported and verified at several shapes";
- onnxmedic: ``onnxmedic.export(...)`` (which verifies at the same shapes, in its sandbox);
- export wall time of both (verification on in both: torch.onnx's ``verify=True``, onnxmedic's
  sandboxed verification) and their ratio;
- ONNX Runtime latency of the exported model against PyTorch eager on the CPU (median);
- the worker's peak resident memory.

    python bench/peers/zoo_bench.py --jobs 2 --results build/zoo_bench.json
    python bench/peers/zoo_bench.py --only bert,gpt2 --zoo bench/zoo/hf.py:DECODE

Results are appended to --results after each entry; --resume skips those already there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))


def _median_ms(fn: Any, warmup: int = 3, runs: int = 15) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _check_at_shapes(path: str, case: Any) -> tuple[bool, str, float]:
    """Verify an ONNX file written by another tool with ``onnxmedic.verify``: the input sets
    and the judge onnxmedic's own export is held to (the example, a further set, each dynamic
    dim at 1 and the prime above the example's size; float64 budget), so both tools' files are
    judged alike. (all verified, why not, worst max abs error)."""
    import onnxmedic

    r = onnxmedic.verify(path, case.model, case.args, kwargs=case.kwargs,
                         tolerance=case.tolerance)
    worst = max((c.max_abs for c in r.verification if c.max_abs == c.max_abs), default=0.0)
    if r.ok:
        return True, "", worst
    bad = r.errors[0] if r.errors else None
    return False, (f"{bad.code}: {bad.message[:200]}" if bad is not None
                   else "not verified"), worst


def _warm_up() -> None:
    """The same one-time costs paid before either tool is timed, in every worker: imports,
    torch.export's and torch.onnx's set-up, ONNX Runtime, onnxmedic's modules - both tools
    export and verify a tiny conv net once."""
    import torch

    import onnxmedic

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2)).eval()
    args = (torch.randn(2, 3, 8, 8),)
    dyn = ({0: "batch"},)
    torch.onnx.export(model, args, dynamic_shapes=dyn, dynamo=True, verify=True, verbose=False)
    with tempfile.TemporaryDirectory() as td:
        onnxmedic.export(model, args, f"{td}/warm.onnx", dynamic_shapes=dyn)


def _torch_onnx(case: Any, td: str) -> dict[str, Any]:
    """torch.onnx.export(dynamo=True, verify=True) timed (wall, the file saved), then its file
    judged at several shapes by onnxmedic.verify (not timed)."""
    import torch

    t0 = time.perf_counter()
    try:
        prog = torch.onnx.export(case.model, case.args, kwargs=case.kwargs,
                                 dynamic_shapes=case.dynamic_shapes, dynamo=True,
                                 verify=True, verbose=False)
        prog.save(f"{td}/plain.onnx")
        seconds = time.perf_counter() - t0
    except Exception as e:
        inner = e  # torch.onnx wraps the cause in a step banner; report the cause
        while inner.__cause__ is not None:
            inner = inner.__cause__
        return {"torch_onnx_seconds": time.perf_counter() - t0, "torch_onnx_ok": False,
                "torch_onnx_error": f"{type(inner).__name__}: "
                f"{(str(inner).strip().splitlines() or [''])[0][:300]}"}
    ok, why, err = _check_at_shapes(f"{td}/plain.onnx", case)
    return {"torch_onnx_seconds": seconds, "torch_onnx_ok": ok, "torch_onnx_error": why,
            "torch_onnx_max_abs": err}


def _onnxmedic(entry: Any, case: Any, td: str, threads: int,
               latency_runs: int) -> dict[str, Any]:
    """onnxmedic.export with its verification, timed (wall), and the latency of its file."""
    import torch

    from onnxmedic.sweep.worker import export_case

    med = export_case(entry, case, {"out_dir": td, "verify": True}, time.perf_counter())
    rec = {"onnxmedic_ok": med["ok"], "onnxmedic_seconds": med["export_seconds"],
           "onnxmedic_max_abs": med["max_abs"], "failed_stage": med["failed_stage"],
           "onnxmedic_findings": sorted({f["code"] for f in med["findings"]}),
           "onnxmedic_error": next((f"{f['code']}: {f['message'][:300]}"
                                    for f in med["findings"] if f["severity"] == "error"), ""),
           "note": med["note"], "check": med.get("check"),
           "onnxmedic_timings": med.get("timings")}
    if med["ok"] and latency_runs > 0:
        import onnx
        import onnxruntime as ort

        from onnxmedic.onnxfile import graph_io, make_feeds

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        path = med["path"]
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        feeds = make_feeds(graph_io(onnx.load(path, load_external_data=False))[0],
                           case.args, case.kwargs)
        rec["ort_ms"] = _median_ms(lambda: sess.run(None, feeds), min(3, latency_runs),
                                   latency_runs)
        with torch.no_grad():
            rec["eager_ms"] = _median_ms(lambda: case.model(*case.args, **case.kwargs),
                                         min(3, latency_runs), latency_runs)
    return rec


TOOLS = ("torch.onnx", "onnxmedic")


def one(zoo: str, name: str, threads: int, latency_runs: int = 15,
        tool: str = "both") -> dict[str, Any]:
    """Everything for one entry, in this (worker) process (``latency_runs``: timed runs of
    ONNX Runtime and eager each, median taken; 0 leaves latency out). ``tool``: one of
    TOOLS (main runs each in a worker of its own, after the same warm-up) or "both" (in this
    process, torch.onnx first)."""
    import logging

    import torch

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(threads)
    from onnxmedic.sweep import as_case, import_source, load_zoo
    from onnxmedic.sweep.worker import peak_rss_mb

    entry = next(e for e in load_zoo(zoo) if e.name == name)
    factory = getattr(import_source(entry.source), entry.attr)[name]
    rec: dict[str, Any] = {"name": name, "threads": threads}
    _warm_up()
    with tempfile.TemporaryDirectory() as td:
        if tool in ("both", "torch.onnx"):
            rec.update(_torch_onnx(as_case(factory(), name), td))
        if tool in ("both", "onnxmedic"):  # a fresh model: nothing left over from torch.onnx
            rec.update(_onnxmedic(entry, as_case(factory(), name), td, threads, latency_runs))
    rec["peak_rss_mb"] = peak_rss_mb()
    return rec


def run_pair(zoo: str, name: str, timeout: float, threads: int,
             extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """torch.onnx and onnxmedic on one entry, each in a fresh worker (one after the other,
    each with ``timeout`` and the same warm-up): one record. Peak memory is onnxmedic's
    worker's; a crashed worker's message is kept under "crashed"."""
    rec: dict[str, Any] = {"name": name}
    for tool in TOOLS:
        r = _run_child(zoo, name, timeout, threads, __file__, (*extra, "--tool", tool))
        if "crashed" in r:
            return {**rec, **r, "crashed": f"{tool}: {r['crashed']}"}
        seconds = rec.get("seconds", 0.0) + r.pop("seconds", 0.0)
        rec.update(r, seconds=seconds)
    return rec


def _run_child(zoo: str, name: str, timeout: float, threads: int, script: str = __file__,
               extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``script --zoo ZOO --one NAME --out FILE --threads N *extra`` in its own process group,
    killed after ``timeout``: the record it wrote, or {"name", "crashed": why}."""
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "r.json"
        cmd = [sys.executable, script, "--zoo", zoo, "--one", name, "--out", str(out),
               "--threads", str(threads), *extra]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(Path(td) / "log", "w"),
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            return {"name": name, "crashed": f"timeout after {timeout:g} s",
                    "seconds": time.perf_counter() - t0}
        if out.is_file():
            rec = json.loads(out.read_text())
            rec["seconds"] = time.perf_counter() - t0
            return rec
        log = (Path(td) / "log").read_text(errors="replace")[-500:]
        return {"name": name, "crashed": f"exit {rc}: {log}", "seconds": time.perf_counter() - t0}


def zoo_flags(doc: str, zoo: str, results: str, timeout: float) -> argparse.ArgumentParser:
    """The flags a zoo benchmark takes (defaults: ``bench/zoo/<zoo>``, ``build/<results>``),
    and the worker's own (--one NAME --out FILE --threads N)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--zoo", default=str(ROOT / "bench" / "zoo" / zoo))
    ap.add_argument("--only", default="")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=timeout)
    ap.add_argument("--results", default=str(ROOT / "build" / results))
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--table", action="store_true", help="only print the table of --results")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--latency-runs", type=int, default=15,
                    help="timed runs of ONNX Runtime and eager per entry (0: no latency)")
    ap.add_argument("--tool", default="both", choices=("both", *TOOLS),
                    help=argparse.SUPPRESS)
    return ap


def child_record(out: str, run: Any, ident: dict[str, Any]) -> int:
    """In the worker: ``run()``'s record written to ``out`` - or, where it raised, ``ident``
    with "crashed" and the traceback (an exception out of onnxmedic is a defect to report)."""
    try:
        rec = run()
    except Exception as e:
        rec = {**ident, "crashed": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-2000:]}
    Path(out).write_text(json.dumps(rec, default=str))
    return 0


def prior_results(path: str, keep: bool) -> tuple[Path, list[dict[str, Any]]]:
    """The results file (its folder made) and the records already in it where ``keep``."""
    results = Path(path)
    results.parent.mkdir(parents=True, exist_ok=True)
    return results, json.loads(results.read_text()) if keep and results.exists() else []


def table(recs: list[dict[str, Any]]) -> str:
    lines = ["| model | torch.onnx | onnxmedic | export s torch.onnx | export s onnxmedic | "
             "ratio | ORT ms | eager ms | peak MiB | why not (onnxmedic / torch.onnx) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "" if x is None else fmt.format(x)

    for r in sorted(recs, key=lambda r: r["name"]):
        if "crashed" in r:
            lines.append(f"| {r['name']} | ? | ✘ | | | | | | | worker: {r['crashed'][:120]} |")
            continue
        ratio = (r["onnxmedic_seconds"] / r["torch_onnx_seconds"]
                 if r.get("onnxmedic_seconds") and r.get("torch_onnx_seconds") else None)
        why = " / ".join(x for x in (r.get("onnxmedic_error", "")[:160],
                                     r.get("torch_onnx_error", "")[:160]) if x)
        lines.append(
            f"| {r['name']} | {'✔' if r.get('torch_onnx_ok') else '✘'} | "
            f"{'✔' if r.get('onnxmedic_ok') else '✘'} | {f(r.get('torch_onnx_seconds'), '{:.1f}')} | "
            f"{f(r.get('onnxmedic_seconds'), '{:.1f}')} | {f(ratio)} | {f(r.get('ort_ms'))} | "
            f"{f(r.get('eager_ms'))} | {f(r.get('peak_rss_mb'), '{:.0f}')} | "
            f"{why.replace('|', '/')} |")
    ok_t = sum(1 for r in recs if r.get("torch_onnx_ok"))
    ok_m = sum(1 for r in recs if r.get("onnxmedic_ok"))
    both = [r["onnxmedic_seconds"] / r["torch_onnx_seconds"] for r in recs
            if r.get("onnxmedic_ok") and r.get("torch_onnx_ok") and r.get("torch_onnx_seconds")]
    speed = [r["eager_ms"] / r["ort_ms"] for r in recs if r.get("ort_ms")]
    rss = [r["peak_rss_mb"] for r in recs if r.get("peak_rss_mb")]
    lines += ["", f"exported and verified at several shapes: torch.onnx {ok_t}/{len(recs)}, "
              f"onnxmedic {ok_m}/{len(recs)}",
              f"export time onnxmedic / torch.onnx (both verified, {len(both)} models): median "
              f"{statistics.median(both):.2f}x" if both else "export time ratio: n/a",
              f"ONNX Runtime speed-up over eager (median over {len(speed)}): "
              f"{statistics.median(speed):.2f}x" if speed else "latency: n/a",
              f"peak memory per worker: median {statistics.median(rss):.0f} MiB, max "
              f"{max(rss):.0f} MiB" if rss else ""]
    return "\n".join(lines)


def main() -> int:
    ns = zoo_flags(__doc__, "hf.py:ALL", "zoo_bench.json", 900).parse_args()
    if ns.one:
        return child_record(ns.out, lambda: one(ns.zoo, ns.one, ns.threads, ns.latency_runs,
                                                        ns.tool),
                            {"name": ns.one})
    from onnxmedic.report.files import atomic_write_text
    from onnxmedic.sweep import load_zoo

    results, recs = prior_results(ns.results, ns.resume or ns.table)
    if ns.table:
        print(table(recs))
        return 0
    done = {r["name"] for r in recs}
    names = [e.name for e in load_zoo(ns.zoo) if e.name not in done and
             (not ns.only or e.name in ns.only.split(","))]
    threads = max(1, (os.cpu_count() or 1) // ns.jobs)
    with ThreadPoolExecutor(ns.jobs) as pool:
        futs = [pool.submit(run_pair, ns.zoo, n, ns.timeout, threads,
                            ("--latency-runs", str(ns.latency_runs))) for n in names]
        for fut in as_completed(futs):
            r = fut.result()
            recs = [x for x in recs if x["name"] != r["name"]] + [r]
            atomic_write_text(results, json.dumps(recs, indent=1, default=str))
            print(f"{r['name']}: torch.onnx {'ok' if r.get('torch_onnx_ok') else 'FAIL'}, "
                  f"onnxmedic {'ok' if r.get('onnxmedic_ok') else 'FAIL'} "
                  f"({r.get('seconds', 0):.0f} s)", flush=True)
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
