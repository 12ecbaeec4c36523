"""Shared helper for the per-family latency benchmarks: ONNX Runtime vs PyTorch eager.

Each ``bench/latency/latency_<family>.py`` lists cases (name, fn, args) and calls :func:`main`.
Prints a table of median latencies and the ratio ORT / eager; ``--json`` for machine output.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

from onnxmedic._tensors import to_numpy  # noqa: E402
from onnxmedic.ops.testing import export_call  # noqa: E402

Case = tuple[str, Callable[..., Any], tuple[Any, ...]]


def _median_time(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(case: Case, repeat: int = 50, threads: int = 1) -> dict[str, Any]:
    """threads=0 keeps both libraries' own defaults (ORT's and PyTorch's intra-op pools)."""
    import onnxruntime as ort

    name, fn, args = case
    if threads > 0:
        torch.set_num_threads(threads)
    model, tensors = export_call(fn, args)
    opts = ort.SessionOptions()
    if threads > 0:
        opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    feeds = {i.name: to_numpy(t) for i, t in zip(sess.get_inputs(), tensors)}
    t_ort = _median_time(lambda: sess.run(None, feeds), repeat)
    with torch.no_grad():
        t_eager = _median_time(lambda: fn(*args), repeat)
    return {"case": name, "eager_us": t_eager * 1e6, "ort_us": t_ort * 1e6,
            "ratio": t_ort / t_eager, "nodes": len(model.graph.node)}


def main(cases: list[Case], title: str) -> None:
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads for both ORT and PyTorch; 0 = each library's default")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", metavar="REGEX", default=None,
                   help="run only the cases whose name matches REGEX (re.search)")
    a = p.parse_args()
    if a.only:
        cases = [c for c in cases if re.search(a.only, c[0])]
    rows = []
    for case in cases:
        try:
            rows.append(measure(case, a.repeat, a.threads))
        except Exception as e:  # a broken case is a row, not a crash
            rows.append({"case": case[0], "error": f"{type(e).__name__}: {e}"[:200]})
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    threads = a.threads if a.threads > 0 else f"default ({torch.get_num_threads()})"
    t = Table(title=f"{title} (threads={threads}, median of {a.repeat})")
    for col in ("case", "eager µs", "ORT µs", "ORT/eager", "ONNX nodes"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["case"], "-", "-", r["error"], "-")
        else:
            t.add_row(r["case"], f"{r['eager_us']:.1f}", f"{r['ort_us']:.1f}",
                      f"{r['ratio']:.2f}", str(r["nodes"]))
    Console().print(t)
