"""One sweep entry in its own process: build the model, export and verify it, write a record.

Started by onnxmedic.sweep.run_entry as ``python -m onnxmedic.sweep.worker PAYLOAD_JSON``. Its
result is a JSON file written atomically at the end; a worker that dies before (abort,
segfault, out of memory, killed on timeout) leaves none, and the parent records the crash.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident memory of this worker and of its finished children (the sandbox), MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, kids) / 1024.0, 1)  # ru_maxrss is in KiB on Linux


def main(payload: dict[str, Any]) -> int:
    from onnxmedic.findings import error
    from onnxmedic.report.files import atomic_write_text
    from onnxmedic.sweep.results import record
    from onnxmedic.sweep.zoo import Entry, as_case, import_source

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    if payload.get("threads"):
        import torch

        torch.set_num_threads(int(payload["threads"]))
    entry = Entry(payload["name"], payload["source"], payload.get("attr", "ZOO"))
    t0 = time.perf_counter()
    try:
        zoo = getattr(import_source(entry.source), entry.attr)
        case = as_case(zoo[entry.name](), entry.name)
    except Exception as e:
        rec = record(entry, "factory-failed", time.perf_counter() - t0, findings=[error(
            "OM703", "sweep", f"{entry.name}: the zoo factory failed: {type(e).__name__}: "
            f"{str(e).strip()[:400]}", suggestion="Fix the entry's factory (its config or "
            "inputs); the traceback is in the details.",
            details={"traceback": traceback.format_exc()[-3000:]})])
        atomic_write_text(payload["out"], json.dumps(rec, default=str))
        return 0
    rec = export_case(entry, case, payload, t0)
    atomic_write_text(payload["out"], json.dumps(rec, default=str))
    return 0


def export_case(entry: Any, case: Any, payload: dict[str, Any], t0: float) -> dict[str, Any]:
    """Export and verify one ZooCase with onnxmedic.export; the record for the results file."""
    from onnxmedic.api import export
    from onnxmedic.findings import error
    from onnxmedic.sweep.results import record

    out_dir = payload.get("out_dir")
    with tempfile.TemporaryDirectory(prefix="onnxmedic-entry-") as td:
        safe = "".join(c if c.isalnum() or c in "-_.+" else "_" for c in entry.name)
        f = Path(out_dir or td) / f"{safe}.onnx"
        t1 = time.perf_counter()
        res = export(case.model, case.args, f, kwargs=case.kwargs,
                     dynamic_shapes=case.dynamic_shapes,
                     verify=payload.get("verify", True), tolerance=case.tolerance)
        export_seconds = time.perf_counter() - t1
        d = res.to_dict()
        summary = d["verification_summary"]
        findings = d["findings"]
        check = None
        ok = res.ok
        if ok and case.check is not None:
            try:
                check = case.check(str(f), case)
            except Exception as e:
                check = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
            if not check.get("ok"):
                ok = False
                findings.append(error(
                    "OM710", "check", f"{entry.name}: the entry's own check failed after a "
                    f"verified export: {check.get('error') or check.get('message') or check}",
                    suggestion="The details hold the check's figures.",
                    details={"check": check}).to_dict())
        status = "verified" if ok else "failed"
        return record(
            entry, status, time.perf_counter() - t0, findings=[], stages=d["stages"],
            failed_stage=d["failed_stage"] or ("check" if res.ok and not ok else None),
            max_abs=max((v["max_abs"] for v in summary.values()), default=None),
            max_rel=max((v["max_rel"] for v in summary.values()), default=None),
            export_seconds=round(export_seconds, 3), peak_rss_mb=peak_rss_mb(),
            note=case.note, check=check, opset=d["opset"], timings=d["timings"],
            capture_attempts=d["capture_attempts"],
            path=str(f) if out_dir and f.is_file() else None,
        ) | {"findings": findings}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m onnxmedic.sweep.worker PAYLOAD_JSON\n")
        sys.exit(2)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(json.loads(sys.argv[1])))
