"""Overhead of `onnxmedic export` (with verification) against torch.onnx.export(dynamo=True,
verify=True), measured in the same run on small models plain torch.onnx handles.

Two views:
- cli: each export in a fresh process, as a user runs it (`onnxmedic export ...` against a
  script calling torch.onnx.export(..., verify=True) and saving the file); wall time and peak
  RSS of the process (ru_maxrss, children included — for onnxmedic that is the sandbox child).
- api: in one warm process, onnxmedic.export(...) against torch.onnx.export(..., verify=True).

Median of --repeat runs (default 3), alternating the two tools. Target: ratio <= 1.3.
Usage: python bench/peers/overhead.py [--repeat 3] [--mode cli|api|both] [--json out.json]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = [
    ("mlp", "bench/peers/overhead_models.py:MLP", ["8x64:float32"]),
    ("conv", "bench/peers/overhead_models.py:SmallConvNet", ["2x3x32x32:float32"]),
    ("attention", "bench/peers/overhead_models.py:TinyTransformer", ["2x16x32:float32"]),
    ("norm", "tests/models.py:CustomNorm", ["4x8:float32"]),
]

_TORCH_SCRIPT = r"""
import sys, warnings, logging
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
logging.getLogger("torch.onnx").setLevel(logging.ERROR)
import torch
from onnxmedic import inputs
model, _ = inputs.load_model({spec!r})
model.eval()
ex = inputs.load_inputs({inputs!r})
prog = torch.onnx.export(model, ex.args, {out!r}, kwargs=ex.kwargs, dynamo=True, verify=True,
                         verbose=False)
"""

_ONNXMEDIC_SCRIPT = r"""
import sys
sys.path.insert(0, {root!r})
from onnxmedic.cli import main
rc = main(["export", {spec!r}, *sum((["--input", i] for i in {inputs!r}), []), "-o", {out!r}])
sys.exit(rc)
"""

_WRAP = r"""
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True)
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": p.returncode, "wall": wall, "rss_kb": rss}))
sys.stderr.write(p.stderr[-2000:] if p.returncode else "")
"""


def _run_cli(code: str) -> dict:
    p = subprocess.run([sys.executable, "-c", _WRAP, code], capture_output=True, text=True,
                       cwd=ROOT)
    line = p.stdout.strip().splitlines()[-1]
    d = json.loads(line)
    if d["rc"] != 0:
        raise RuntimeError(f"export failed (rc {d['rc']}): {p.stderr[-800:]}")
    return d


def bench_cli(repeat: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec, ins in MODELS:
            t_times, m_times, t_rss, m_rss = [], [], [], []
            for i in range(repeat):
                out = os.path.join(tmp, f"{name}_{i}")
                tc = _TORCH_SCRIPT.format(root=str(ROOT / "src"), spec=spec, inputs=ins,
                                          out=out + "_t.onnx")
                mc = _ONNXMEDIC_SCRIPT.format(root=str(ROOT / "src"), spec=spec, inputs=ins,
                                              out=out + "_m.onnx")
                for label, code in (("t", tc), ("m", mc)) if i % 2 == 0 else (("m", mc),
                                                                                ("t", tc)):
                    d = _run_cli(code)
                    (t_times if label == "t" else m_times).append(d["wall"])
                    (t_rss if label == "t" else m_rss).append(d["rss_kb"] / 1024)
            rows.append(_row(name, "cli", t_times, m_times, max(t_rss), max(m_rss)))
    return rows


def bench_api(repeat: int) -> list[dict]:
    import logging
    import warnings

    import torch

    sys.path.insert(0, str(ROOT / "src"))
    import onnxmedic
    from onnxmedic import inputs

    warnings.simplefilter("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec, ins in MODELS:
            model, _ = inputs.load_model(spec)
            model.eval()
            ex = inputs.load_inputs(ins)
            # warm-up both paths once (imports, registries, caches)
            torch.onnx.export(model, ex.args, os.path.join(tmp, "w.onnx"), dynamo=True,
                              verify=True, verbose=False)
            onnxmedic.export(model, ex.args, os.path.join(tmp, "w2.onnx"))
            t_times, m_times = [], []
            for i in range(repeat):
                t0 = time.perf_counter()
                torch.onnx.export(model, ex.args, os.path.join(tmp, f"t{i}.onnx"), dynamo=True,
                                  verify=True, verbose=False)
                t_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = onnxmedic.export(model, ex.args, os.path.join(tmp, f"m{i}.onnx"))
                m_times.append(time.perf_counter() - t0)
                assert r.ok, [f.one_paragraph() for f in r.findings]
            rows.append(_row(name, "api", t_times, m_times, None, None))
    return rows


def _row(name, mode, t_times, m_times, t_rss, m_rss) -> dict:
    t, m = statistics.median(t_times), statistics.median(m_times)
    return {"model": name, "mode": mode, "torch_onnx_s": t, "onnxmedic_s": m, "ratio": m / t,
            "torch_onnx_peak_mb": t_rss, "onnxmedic_peak_mb": m_rss,
            "runs": len(t_times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mode", choices=["cli", "api", "both"], default="both")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args()
    rows = []
    if a.mode in ("cli", "both"):
        rows += bench_cli(a.repeat)
    if a.mode in ("api", "both"):
        rows += bench_api(a.repeat)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"onnxmedic export (verified) vs torch.onnx.export(dynamo=True, verify=True)"
                    f", median of {a.repeat}")
    for col in ("model", "mode", "torch.onnx s", "onnxmedic s", "ratio", "torch.onnx peak MB",
                "onnxmedic peak MB"):
        t.add_column(col, justify="left" if col in ("model", "mode") else "right")
    for r in rows:
        t.add_row(r["model"], r["mode"], f"{r['torch_onnx_s']:.2f}", f"{r['onnxmedic_s']:.2f}",
                  f"{r['ratio']:.2f}",
                  f"{r['torch_onnx_peak_mb']:.0f}" if r["torch_onnx_peak_mb"] else "-",
                  f"{r['onnxmedic_peak_mb']:.0f}" if r["onnxmedic_peak_mb"] else "-")
    Console().print(t)
    for mode in sorted({r["mode"] for r in rows}):
        ratios = [r["ratio"] for r in rows if r["mode"] == mode]
        print(f"{mode}: median ratio {statistics.median(ratios):.2f} (target <= 1.3)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
