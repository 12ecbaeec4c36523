"""Big models: wall time and peak resident memory of onnxmedic against plain torch.onnx, on
decoders built from configs (random weights, no downloads) at growing sizes.
For onnxmedic the peak is also broken down by stage (the innermost timed block running when
the sample was taken: capture, translate, check, fix, runtime, compare, write, ...).

Each export runs in a fresh process; the parent samples the resident memory of that process
and all its descendants (onnxmedic's sandbox child included) every 50 ms and keeps the peak
of the sum. onnxmedic: onnxmedic.export(model, (ids,), path) with verification. torch.onnx:
torch.onnx.export(model, (ids,), path, dynamo=True, external_data=True, verify=True).

Goals (issue "Big models"): peak <= 2.5x the parameter bytes, time <= 1.5x torch.onnx's export
with verification, both growing linearly with size.

Usage: python bench/big_models.py [--sizes 0.1,0.5] [--tools onnxmedic,torch.onnx]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Qwen2-shaped decoders: (hidden, layers, intermediate, heads, kv heads), vocab 32000
SIZES = {
    "0.1": (768, 8, 2048, 12, 2),
    "0.25": (1024, 12, 2816, 16, 2),
    "0.5": (1536, 18, 4096, 12, 2),  # the 488M-parameter model
    "1.5": (2048, 28, 5632, 16, 2),
    "3": (2560, 36, 8960, 20, 4),
}

_JOB = r"""
import json, sys, time, warnings, logging, os
sys.path.insert(0, {src!r})
warnings.simplefilter("ignore")
logging.disable(logging.WARNING)
import torch, transformers
hidden, layers, inter, heads, kv = {shape!r}
cfg = transformers.Qwen2Config(hidden_size=hidden, num_hidden_layers=layers,
                               intermediate_size=inter, num_attention_heads=heads,
                               num_key_value_heads=kv, vocab_size=32000,
                               max_position_embeddings=512, use_cache=False)
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(cfg).eval()
params = sum(p.numel() * p.element_size() for p in model.parameters())
ids = torch.randint(0, 32000, (1, 64))
out = {{"params": params}}
t0 = time.perf_counter()
if {tool!r} == "onnxmedic":
    import contextlib
    import onnxmedic
    from onnxmedic import result as _result
    _stack = []
    _timed = _result.ExportResult.timed

    def _mark():  # the innermost timed block, for the parent's per-stage peak
        with open({stage_file!r}, "w") as fh:
            fh.write(_stack[-1] if _stack else "")

    @contextlib.contextmanager
    def timed(self, name):
        _stack.append(name)
        _mark()
        try:
            with _timed(self, name):
                yield
        finally:
            _stack.pop()
            _mark()

    _result.ExportResult.timed = timed
    r = onnxmedic.export(model, (ids,), {path!r})
    out.update(ok=r.ok, timings=r.timings,
               errors=[f.code + ": " + f.message[:200] for f in r.errors])
else:
    try:
        torch.onnx.export(model, (ids,), {path!r}, dynamo=True, external_data=True,
                          verify=True)
        out.update(ok=True)
    except Exception as e:
        out.update(ok=False, errors=[type(e).__name__ + ": " + str(e)[:200]])
out["seconds"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                parts = fh.read().rsplit(")", 1)[1].split()
            ppid, pages = int(parts[1]), int(parts[21])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
        rss[int(d)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def measure(tool: str, size: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bigmodel-") as td:
        stage_file = Path(td) / "stage.txt"
        code = _JOB.format(src=str(ROOT / "src"), shape=SIZES[size], tool=tool,
                           path=str(Path(td) / "model.onnx"), stage_file=str(stage_file))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        peak = 0
        stage_peaks: dict[str, int] = {}
        t0 = time.perf_counter()
        while proc.poll() is None:
            rss = _tree_rss(proc.pid)
            peak = max(peak, rss)
            try:
                stage = stage_file.read_text() or "(between stages)"
            except OSError:
                stage = "(before export)"
            stage_peaks[stage] = max(stage_peaks.get(stage, 0), rss)
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        line = next((ln for ln in proc.stdout.read().splitlines() if ln.startswith("RESULT ")),
                    None)
        rec = json.loads(line[7:]) if line else {"ok": False, "errors": [f"exit {proc.returncode}"]}
        rec.update(tool=tool, size=size, peak_bytes=peak, wall=wall)
        if tool == "onnxmedic":
            rec["stage_peaks"] = stage_peaks
        return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.1,0.5")
    ap.add_argument("--tools", default="onnxmedic,torch.onnx")
    ap.add_argument("--json")
    ns = ap.parse_args()
    rows = []
    for size in ns.sizes.split(","):
        for tool in ns.tools.split(","):
            rec = measure(tool, size)
            rows.append(rec)
            gib = rec.get("params", 0) / 2**30
            print(f"{size:>5} B {tool:<10} ok={rec['ok']!s:<5} params {gib:5.2f} GiB  "
                  f"wall {rec['wall']:6.1f} s  peak {rec['peak_bytes'] / 2**30:5.2f} GiB "
                  f"({rec['peak_bytes'] / max(rec.get('params', 1), 1):.1f}x params)  "
                  + (" ".join(rec.get("errors", []))[:160] if not rec["ok"] else ""),
                  flush=True)
            if rec.get("timings"):
                print("      stages: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                   rec["timings"].items()), flush=True)
            if rec.get("stage_peaks"):
                print("      peak GiB by stage: " + ", ".join(
                    f"{k} {v / 2**30:.2f}" for k, v in rec["stage_peaks"].items()), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
