"""Float16 error amplification on ONNX Runtime's CUDA provider (never run by the tests).

Issue 17's float16 block list has a rule the CPU cannot show: nodes that amplify float16's error
should stay float32. ONNX Runtime's CPU provider runs a chain of float16 nodes in float32 behind
one Cast pair, so `Linear -> (h + 1000) - 1000 -> Linear` verifies there at cosine 0.99999996.
This measures it on CUDA: the plain float16 file (ONNX Runtime's converter, float32 I/O, as
optimize writes it), then the same with each node kept float32 alone, and with the Add and Sub
kept float32 together - the data the rule is to be built on.

    python bench/gpu/gpu_probe_fp16.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def _model():
    import torch

    class Cancel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.b = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = self.a(x)
            return self.b((h + 1000.0) - 1000.0)

    torch.manual_seed(0)
    return Cancel().eval(), torch.randn(8, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ns = ap.parse_args()
    import onnx
    import onnxruntime as ort
    import torch

    from onnxmedic.optimize import fp16
    from onnxmedic.optimize.int8 import cosine

    model, x = _model()
    ref = model(x).detach().numpy()
    rows = []
    with tempfile.TemporaryDirectory() as td:
        src = Path(td) / "m.onnx"
        torch.onnx.export(model, (x,), str(src), dynamo=True)
        proto = onnx.load(str(src))
        name = proto.graph.input[0].name
        nodes = [n.name for n in proto.graph.node if n.op_type not in ("Constant",)]
        variants = [("float32", None), ("float16", [])] + [(f"float16, {n} float32", [n])
                                                           for n in nodes]
        adds = [n.name for n in proto.graph.node if n.op_type in ("Add", "Sub")
                and not any(i in {t.name for t in proto.graph.initializer} for i in n.input[:1])]
        variants.append((f"float16, {'+'.join(adds)} float32", adds))
        for label, block in variants:
            path = src if block is None else Path(td) / f"v{len(rows)}.onnx"
            if block is not None:
                fp16.float16(str(src), str(path), node_block_list=block)
            for prov, opts in (("CUDAExecutionProvider", {"use_tf32": "0"}),
                               ("CPUExecutionProvider", {})):
                t0 = time.perf_counter()
                s = ort.InferenceSession(str(path), providers=[(prov, opts)])
                out = s.run(None, {name: x.numpy()})[0]
                row = {"variant": label, "provider": s.get_providers()[0],
                       "cosine": cosine(out, ref),
                       "max_abs": float(np.abs(out.astype(np.float64) - ref).max()),
                       "seconds": round(time.perf_counter() - t0, 2)}
                rows.append(row)
                print(f"{label:40} {row['provider']:24} cos {row['cosine']:.8f} "
                      f"max abs {row['max_abs']:.3g}", flush=True)
    rows.append(_optimized(model, x))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))


def _optimized(model, x) -> dict:
    """onnxmedic optimize --precision fp16 on the provider the probe ran (CUDA where there
    is one): its float16 candidate, the nodes it kept float32 and why."""
    import onnxruntime as ort
    import torch

    from onnxmedic.optimize import optimize, passes

    target = "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    pipes = [p for p in passes.default_pipelines(precision="fp16") if p.name == "fp16"]
    with tempfile.TemporaryDirectory() as td:
        src = Path(td) / "m.onnx"
        torch.onnx.export(model, (x,), str(src), dynamo=True)
        t0 = time.perf_counter()
        res = optimize(src, model, (x,), precision="fp16", target=target, pipelines=pipes,
                       repeats=5, rounds=1, cuda_graph="off")
    v = res.variants[1]
    row = {"variant": "onnxmedic optimize fp16", "target": target, "verified": v.verified,
           "cosine": v.worst_cosine(), "blocked": v.blocked, "rejected": v.rejected,
           "search": [s for s in v.steps if str(s.get("step", "")).endswith(":amplifiers")],
           "seconds": round(time.perf_counter() - t0, 1)}
    print(f"optimize fp16 on {target}: verified {v.verified}, cos {v.worst_cosine()}, "
          f"kept float32 {sorted(v.blocked)}, {row['seconds']} s; {v.rejected[:300]}",
          flush=True)
    return row


if __name__ == "__main__":
    main()
