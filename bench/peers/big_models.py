"""Big models: wall time and peak resident memory of onnxmedic against plain torch.onnx, on
decoders built from configs (random weights, no downloads) at growing sizes.
For onnxmedic the peak is also broken down by stage (the innermost timed block running when
the sample was taken: capture, translate, check, fix, runtime, compare, write, ...).

Each export runs in a fresh process; the parent samples the resident memory of that process
and all its descendants (onnxmedic's sandbox child included) every 50 ms and keeps the peak
of the sum. onnxmedic: onnxmedic.export(model, (ids,), path) with verification. torch.onnx:
torch.onnx.export(model, (ids,), path, dynamo=True, external_data=True, verify=True); ok only
when none of its own steps printed a failure (a bf16 model's "Execute the model with ONNX
Runtime" fails on the CPU: it is written, never run).

Goals (issue "Big models"): peak <= 2.5x the parameter bytes, time <= 1.5x torch.onnx's export
with verification, both growing linearly with size.

``--dtype bf16`` builds the model in bfloat16, as ``from_pretrained(..., dtype=torch.bfloat16)``
loads a deployed one (the rotary frequencies stay float32), for both tools:
Qwen2.5 deploys in bf16, and float32 ~3 B parameters (12 GiB) cannot be held twice on a 24 GiB
machine. torch.onnx's row runs on the same model and records whatever happens.

Memory cap: each tool's process tree is watched (every 50 ms) and killed, whole tree, when its
resident memory passes ``--cap-gib`` (default 20) or the machine's available memory falls under
``--floor-gib`` (default 1): the row then reads "out of memory at X GiB" instead of the kernel's
OOM killer picking a process of the shared machine. "anon" is the resident memory that is not
file-backed (a memory-mapped weights file's pages are resident but reclaimable page cache).

Usage: python bench/peers/big_models.py [--sizes 0.1,0.5] [--tools onnxmedic,torch.onnx]
       [--dtype float32|bf16] [--cap-gib 20] [--no-localize] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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
# built in its dtype: a float32 model converted after would hold both for a moment (18 GiB
# at 3 B), which the harness, not the export, would be charged with
model = transformers.Qwen2ForCausalLM._from_config(
    cfg, dtype=torch.bfloat16 if {dtype!r} == "bf16" else torch.float32).eval()
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
    r = onnxmedic.export(model, (ids,), {path!r}, localize={localize!r})
    out.update(ok=r.ok, timings=r.timings,
               errors=[f.code + ": " + f.message[:200] for f in r.errors])
else:
    import contextlib, io
    said = io.StringIO()  # its progress lines: a failed step prints a cross, raises nothing
    try:
        with contextlib.redirect_stdout(said):
            torch.onnx.export(model, (ids,), {path!r}, dynamo=True, external_data=True,
                              verify=True)
        failed = [ln.replace("[torch.onnx] ", "") for ln in said.getvalue().splitlines()
                  if "\u274c" in ln]
        out.update(ok=not failed, errors=["exported, but its own step failed: " + ln
                                          for ln in failed[:2]])
    except Exception as e:
        out.update(ok=False, errors=[type(e).__name__ + ": " + str(e)[:200]])
out["seconds"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree_rss(pids: list[int]) -> tuple[int, int]:
    """(resident, anonymous resident) bytes of ``pids``, summed (/proc/PID/statm: resident
    minus shared, i.e. file-backed, pages)."""
    rss = anon = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as fh:
                f = fh.read().split()
            rss += int(f[1]) * PAGE
            anon += (int(f[1]) - int(f[2])) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return rss, anon


def _available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _kill_tree(pids: list[int]) -> None:
    for p in reversed(pids):  # the job and what it started (the sandbox child)
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def measure(tool: str, size: str, dtype: str = "float32", cap: float = 20 * 2**30,
            floor: float = 2**30, localize: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="bigmodel-") as td:
        stage_file = Path(td) / "stage.txt"
        code = _JOB.format(src=str(ROOT / "src"), shape=SIZES[size], tool=tool, dtype=dtype,
                           localize=localize,
                           path=str(Path(td) / "model.onnx"), stage_file=str(stage_file))
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        peak = peak_anon = 0
        stage_peaks: dict[str, int] = {}
        stage_anon: dict[str, int] = {}
        killed = None
        t0 = time.perf_counter()
        while proc.poll() is None:
            pids = _tree(proc.pid)
            rss, anon = _tree_rss(pids)
            peak, peak_anon = max(peak, rss), max(peak_anon, anon)
            try:
                stage = stage_file.read_text() or "(between stages)"
            except OSError:
                stage = "(before export)"
            stage_peaks[stage] = max(stage_peaks.get(stage, 0), rss)
            stage_anon[stage] = max(stage_anon.get(stage, 0), anon)
            if rss > cap or _available() < floor:
                killed = (f"out of memory at {rss / 2**30:.1f} GiB (stage {stage}; cap "
                          f"{cap / 2**30:.1f} GiB, {_available() / 2**30:.1f} GiB left)")
                _kill_tree(pids)
                proc.wait()
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        line = next((ln for ln in proc.stdout.read().splitlines() if ln.startswith("RESULT ")),
                    None)
        rec = json.loads(line[7:]) if line else {"ok": False, "errors": [
            killed or f"exit {proc.returncode}"]}
        rec.update(tool=tool, size=size, dtype=dtype, peak_bytes=peak, peak_anon=peak_anon,
                   wall=wall, oom=killed)
        if tool == "onnxmedic":
            rec["stage_peaks"], rec["stage_anon"] = stage_peaks, stage_anon
        return rec


def _slope(rows: list[dict], key: str) -> float | None:
    """Least-squares slope of ``key`` against parameter GiB over the rows that ran to the end
    (verified or not: a mismatch still ran every stage; not the rows the cap killed)."""
    pts = [(r["params"] / 2**30, r[key]) for r in rows
           if r.get("params") and "seconds" in r and not r.get("oom")]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def _stage_table(rows: list[dict]) -> None:
    """Per-stage peak resident (anonymous) GiB of each onnxmedic row."""
    rows = [r for r in rows if r.get("stage_peaks")]
    if not rows:
        return
    stages: list[str] = []
    for r in rows:
        stages += [s for s in r["stage_peaks"] if s not in stages]
    cols = [f"{r['size']} B {r['dtype']}" for r in rows]
    print("\npeak resident GiB by stage (anonymous in brackets)")
    print(f"{'stage':<18}" + "".join(f"{c:>20}" for c in cols))
    for s in stages:
        cells = []
        for r in rows:
            v, a = r["stage_peaks"].get(s), r["stage_anon"].get(s)
            cells.append(f"{v / 2**30:6.2f} ({a / 2**30:5.2f})" if v is not None else "-")
        print(f"{s:<18}" + "".join(f"{c:>20}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.1,0.5")
    ap.add_argument("--tools", default="onnxmedic,torch.onnx")
    ap.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    ap.add_argument("--cap-gib", type=float, default=20.0,
                    help="kill a tool's process tree above this resident memory")
    ap.add_argument("--floor-gib", type=float, default=1.0,
                    help="kill it when the machine's available memory falls under this")
    ap.add_argument("--no-localize", action="store_true",
                    help="onnxmedic.export(localize=False): a mismatch (OM601) is reported "
                    "without localising it (the localizer exposes every intermediate value)")
    ap.add_argument("--json")
    ns = ap.parse_args()
    rows = []
    for size in ns.sizes.split(","):
        for tool in ns.tools.split(","):
            rec = measure(tool, size, ns.dtype, ns.cap_gib * 2**30, ns.floor_gib * 2**30,
                          not ns.no_localize)
            rows.append(rec)
            gib = rec.get("params", 0) / 2**30
            ratio = (f"{rec['peak_bytes'] / rec['params']:.1f}x params" if rec.get("params")
                     else "params not known: killed first")
            print(f"{size:>5} B {ns.dtype:<7} {tool:<10} ok={rec['ok']!s:<5} params "
                  f"{gib:5.2f} GiB  wall {rec['wall']:6.1f} s  peak "
                  f"{rec['peak_bytes'] / 2**30:5.2f} GiB ({ratio}; anon "
                  f"{rec['peak_anon'] / 2**30:5.2f} GiB)  "
                  + (" ".join(rec.get("errors", []))[:200] if not rec["ok"] else ""),
                  flush=True)
            if rec.get("timings"):
                print("      stages: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                   rec["timings"].items()), flush=True)
    _stage_table(rows)
    for tool in ns.tools.split(","):
        mine = [r for r in rows if r["tool"] == tool]
        st, sp = _slope(mine, "wall"), _slope(mine, "peak_bytes")
        if st is not None:
            print(f"slope {tool}: {st:.1f} s and {sp / 2**30:.2f} GiB peak per GiB of "
                  "parameters", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
