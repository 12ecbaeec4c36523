"""Localisation and reduce on a model of >= 2,000 ONNX nodes, against one plain verify, in the
same run.

The model is a deep stack of small residual blocks (Linear, LayerNorm, GELU, add); it is
exported with onnxmedic, then one Add in the middle is turned into a Sub, so that verification
fails and localisation has a divergence to find. Each measurement runs in a fresh Python
process, so its peak RSS (self + children: the sandbox's ONNX Runtime) is its own.

    PYTHONPATH=src python bench/accuracy/localize.py [--blocks 400] [--width 32] [--batch 16]
                                            [--chunk-mb MB]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
NAMES = {"verify": "verify", "localize": "verify --localize (nn.Module given)",
         "localize_ep": "verify --localize (ExportedProgram given)",
         "reduce": "reduce --until mismatch",
         "export": "export, mismatching (localize=False)",
         "export_localize": "export, mismatching (localises itself)"}


class DeepStack(nn.Module):
    """``blocks`` residual blocks x + gelu(layer_norm(linear(x))) * 0.5: 5 ONNX nodes each."""

    def __init__(self, blocks: int = 400, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.norm = nn.ModuleList(nn.LayerNorm(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.lin, self.norm):
            x = x + torch.nn.functional.gelu(norm(lin(x))) * 0.5
        return x


def _peak_mib() -> tuple[float, float]:
    """Peak RSS of this process and of its largest child (the sandbox), in MiB."""
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return self_kb / 1024, child_kb / 1024


def child(mode: str, work: Path, blocks: int, width: int, batch: int) -> None:
    """One measurement in this fresh process; prints a JSON line."""
    import onnxmedic
    from onnxmedic.verify import localize as loc_mod

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    if os.environ.get("BENCH_CHUNK_MB"):
        loc_mod.DEFAULT_CHUNK_BYTES = int(float(os.environ["BENCH_CHUNK_MB"]) * 2**20)
    x = torch.load(work / "x.pt", weights_only=True)
    model = DeepStack(blocks, width).eval()
    t0 = time.perf_counter()
    if mode == "verify":
        res = onnxmedic.verify(work / "bad.onnx", model, (x,))
        extra = {}
    elif mode in ("export", "export_localize"):
        # export with a deliberately wrong gelu translation: it mismatches (OM601), and with
        # localize on, export localises by itself; the difference is what localising adds
        from onnxscript import opset18 as op

        from onnxmedic.ops import translation

        @translation(torch.ops.aten.gelu.default)
        def aten_gelu_default(self, approximate="none"):
            return op.Sigmoid(self)

        t0 = time.perf_counter()
        res = onnxmedic.export(model, (x,), localize=mode == "export_localize")
        loc = res.localization
        extra = {"localize_s": res.timings.get("localize", 0.0),
                 "first": loc.first.aten_op if loc and loc.first else None}
    elif mode in ("localize", "localize_ep"):
        if mode == "localize_ep":  # the program at hand, as in export (capture not timed)
            model = torch.export.export(model, (x,))
            t0 = time.perf_counter()
        res = onnxmedic.verify(work / "bad.onnx", model, (x,), localize=True)
        loc = res.localization
        extra = {"first": loc.first.fx_node if loc.first else None, "compared": loc.compared,
                 "program": getattr(loc, "program", "torch.export"),
                 "chunks": loc.chunks, "localize_s": res.timings.get("localize", 0.0)}
    else:
        res = onnxmedic.reduce(work / "bad.onnx", work / "min.onnx", until="mismatch",
                               feeds=work / "feeds.npz", reference=work / "ref.npz",
                               timeout=60)
        import onnx

        extra = {"nodes_out": len(onnx.load(work / "min.onnx").graph.node) if res.ok else None,
                 "runs": res.timings.get("reduce_runs")}
    seconds = time.perf_counter() - t0
    peak_self, peak_child = _peak_mib()
    print(json.dumps({"mode": mode, "seconds": seconds, "peak_self": peak_self,
                      "peak_child": peak_child,
                      "codes": sorted({f.code for f in res.findings}), **extra}))


_ORT_PEAK = """
import sys, numpy as np, onnxruntime as ort
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
feeds = dict(np.load(sys.argv[2]))
outs = [np.asarray(o) for o in sess.run(None, feeds)]
np.savez(sys.argv[3], **{f"o{i}": o for i, o in enumerate(outs)})
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
print(int(hwm.split()[1]) // 1024, sum(o.nbytes for o in outs) // 2**20)
"""


def ort_peak(work: Path, model: Path) -> tuple[int, int]:
    """Peak RSS (MiB, VmHWM: ru_maxrss of a child counts its parent's pages at exec) of a
    process doing what the sandbox worker does with ``model``, and MiB of outputs."""
    p = subprocess.run([sys.executable, "-c", _ORT_PEAK, str(model), str(work / "feeds.npz"),
                        str(work / "out.npz")], capture_output=True, text=True, check=True)
    peak, out_mib = p.stdout.split()
    return int(peak), int(out_mib)


def exposed_largest_chunk(work: Path, program: object, chunk_mb: float | None) -> Path:
    """bad.onnx with the largest chunk localisation exposes as its outputs."""
    import onnx

    from onnxmedic.verify import localize as loc_mod

    proto = onnx.load(work / "bad.onnx")
    nodes, _ = loc_mod._candidates(program, proto)
    chunk = int(chunk_mb * 2**20) if chunk_mb else loc_mod.DEFAULT_CHUNK_BYTES
    chunks = loc_mod.value_chunks(nodes, chunk)
    biggest = max(chunks, key=lambda c: sum(n.meta["val"].numel() for n in c))
    m = loc_mod._with_outputs(proto, [n.name for n in biggest], loc_mod._value_types(proto))
    onnx.save(m, work / "exposed.onnx")
    return work / "exposed.onnx"


def prepare(work: Path, blocks: int, width: int, batch: int) -> tuple[int, str, object]:
    """Export the model, corrupt one Add in the middle; returns (ONNX nodes, its FX name)."""
    import numpy as np
    import onnx
    from onnx.reference import ReferenceEvaluator

    import onnxmedic

    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
    torch.save(x, work / "x.pt")
    res = onnxmedic.export(DeepStack(blocks, width).eval(), (x,), work / "good.onnx")
    assert res.ok, [f.one_paragraph() for f in res.findings]
    m = onnx.load(work / "good.onnx")
    adds = [n for n in m.graph.node if n.op_type == "Add"]
    target = adds[len(adds) // 2]
    target.op_type = "Sub"
    onnx.save(m, work / "bad.onnx")
    feeds = {"x": x.numpy()}
    np.savez(work / "feeds.npz", **feeds)
    ref = ReferenceEvaluator(onnx.load(work / "good.onnx")).run(None, feeds, intermediate=True)
    np.savez(work / "ref.npz", **{k: v for k, v in ref.items()
                                  if isinstance(v, np.ndarray) and v.dtype != object})
    return len(m.graph.node), target.output[0], res.program


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--child", choices=list(NAMES))
    ap.add_argument("--work")
    ap.add_argument("--modes", default=",".join(NAMES),
                    help=f"comma-separated subset of {', '.join(NAMES)}")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in every measured process (default 1: on a shared "
                    "machine, spinning OpenMP threads make tiny ops erratic)")
    ap.add_argument("--chunk-mb", type=float,
                    help="bytes of exposed values per sandbox run (default: localize's 256 MiB)")
    ns = ap.parse_args()
    if ns.child:
        child(ns.child, Path(ns.work), ns.blocks, ns.width, ns.batch)
        return
    with tempfile.TemporaryDirectory(prefix="bench-localize-") as d:
        work = Path(d)
        t0 = time.perf_counter()
        n_nodes, target, program = prepare(work, ns.blocks, ns.width, ns.batch)
        export_s = time.perf_counter() - t0
        ort_plain = ort_peak(work, work / "bad.onnx")
        ort_exposed = ort_peak(work, exposed_largest_chunk(work, program, ns.chunk_mb))
        rows = {}
        env = dict(os.environ, PYTHONPATH=str(HERE.parents[1] / "src"))
        env["BENCH_THREADS"] = str(ns.threads)
        if ns.chunk_mb:
            env["BENCH_CHUNK_MB"] = str(ns.chunk_mb)
        for mode in ["verify"] + [m for m in ns.modes.split(",") if m != "verify"]:
            p = subprocess.run([sys.executable, __file__, "--child", mode, "--work", str(work),
                                "--blocks", str(ns.blocks), "--width", str(ns.width),
                                "--batch", str(ns.batch)], capture_output=True, text=True,
                               env=env)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not line:
                sys.exit(f"{mode} failed:\n{p.stderr[-3000:]}")
            rows[mode] = json.loads(line[-1])
    v = rows["verify"]
    print(f"model: DeepStack(blocks={ns.blocks}, width={ns.width}), batch {ns.batch}: "
          f"{n_nodes} ONNX nodes, {n_nodes * ns.batch * ns.width * 4 / 2**20:.0f} MiB of "
          f"intermediate values; corrupted node {target} (export + setup {export_s:.1f} s); "
          f"chunk {ns.chunk_mb or 256:g} MiB; torch threads {ns.threads}")
    for key in ("localize", "localize_ep"):
        if key not in rows:
            continue
        lo = rows[key]
        print(f"{key}: named {lo['first']} ({'right' if lo['first'] == target else 'WRONG'}); "
              f"{lo['compared']} values compared in {lo['chunks']} sandbox run(s); PyTorch "
              f"program from {lo['program']}")
    if "reduce" in rows:
        r = rows["reduce"]
        print(f"reduce: {r['nodes_out']} node(s) in {r['runs']:.0f} runs")
    if "export_localize" in rows:
        el = rows["export_localize"]
        print(f"export with a wrong gelu translation localised: {el['first']}; its localise stage "
              f"took {el['localize_s']:.2f} s of {el['seconds']:.2f} s "
              f"({el['localize_s'] / v['seconds']:.2f}x one verify)")
    head = ("run", "nodes", "seconds", "x verify", "localise stage s", "peak MiB self",
            "peak MiB sandbox")
    table = [head]
    for key, row in rows.items():
        table.append((NAMES[key], str(n_nodes), f"{row['seconds']:.2f}",
                      f"{row['seconds'] / v['seconds']:.2f}x",
                      f"{row['localize_s']:.2f}" if "localize_s" in row else "",
                      f"{row['peak_self']:.0f}", f"{row['peak_child']:.0f}"))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print(" | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))))
    print("('peak MiB sandbox' is ru_maxrss of children, which counts the parent's pages at "
          "fork+exec; the ONNX Runtime side measured alone, VmHWM:)")
    print(f"ONNX Runtime run of the model: {ort_plain[0]} MiB peak; with localisation's "
          f"largest chunk exposed ({ort_exposed[1]} MiB of outputs): {ort_exposed[0]} MiB peak")


if __name__ == "__main__":
    main()
