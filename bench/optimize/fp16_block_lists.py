"""What the float16 block list keeps in float32 on issue 17's transformer models, with and
without mask fill values saturating (OM727) - a CPU check of the graphs `--precision fp16`
will time on a GPU.

    PYTHONPATH=src python bench/optimize/fp16_block_lists.py [--models gpt2,bert,llama,...]

Per model (bench/optimize/optimize.py's real-size models, random weights): the plain torch.onnx export,
onnxscript's ORT fusions (the ort-fusions-fp16 candidate's graph), its float32 values measured
on the example (fp16.range_stats), then the block list two ways - strict (every value over
65504 blocks its nodes) and saturating (values over it only in fill values do not) - each
converted to float16 and run on the CPU provider against the float32 fused file: nodes kept
float32 by op type, Casts in the file, worst cosine and max abs error. Nothing here is timed:
the CPU runs float16 nodes behind Casts; the speed is the GPU's to measure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import optimize as bench_optimize  # noqa: E402 - bench/optimize/optimize.py's models


def _run(path: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def one(name: str, folder: Path) -> list[dict[str, Any]]:
    import onnx

    from onnxmedic.optimize import files, fp16, passes
    from onnxmedic.optimize.int8 import cosine as _cosine

    torch.manual_seed(0)
    model, args, _ = bench_optimize.MODELS[name]()
    plain, fused, named = folder / "p.onnx", folder / "f.onnx", folder / "n.onnx"
    torch.onnx.export(model.eval(), args, str(plain), dynamo=True, verbose=False)
    new_ops = passes.ort_fusions(str(plain), str(fused))["new_ops"]
    fp16.name_nodes(str(fused), str(named))
    graph = onnx.load(str(named), load_external_data=False).graph
    feed = {i.name: a.numpy() for i, a in zip(graph.input, args)}
    files.save_feeds([feed], folder / "feeds.npz")
    values = fp16.range_stats(str(named), "", str(folder / "feeds.npz"))["values"]
    ops = {n.name: n.op_type for n in graph.node}
    want = _run(named, feed)
    rows = []
    for label, saturate in (("strict", False), ("saturating", True)):
        blocked = fp16.block_list(named, values, saturate=saturate)
        out = folder / f"{label}.onnx"
        fp16.float16(str(named), str(out), node_block_list=sorted(blocked))
        got = _run(out, feed)
        nodes = onnx.load(str(out), load_external_data=False).graph.node
        rows.append({
            "model": name, "block list": label, "fused": new_ops,
            "kept float32": dict(Counter(ops[n] for n in blocked)),
            "saturated values": len(fp16.saturated(values)) if saturate else 0,
            "casts": sum(n.op_type == "Cast" for n in nodes),
            "cosine": min(_cosine(w, g) for w, g in zip(want, got)),
            "max abs": max(float(np.abs(w.astype(np.float64) - g).max())
                           for w, g in zip(want, got))})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,bert,llama")
    ns = ap.parse_args()
    print("| model | block list | nodes kept float32 | fill values saturated | Casts | "
          "worst cosine | max abs error |\n|---|---|---|---|---|---|---|")
    for name in ns.models.split(","):
        with tempfile.TemporaryDirectory(prefix="onnxmedic-fp16bl-") as td:
            for r in one(name, Path(td)):
                kept = ", ".join(f"{k} {v}" for k, v in r["kept float32"].items()) or "none"
                print(f"| {r['model']} | {r['block list']} | {kept} | {r['saturated values']} | "
                      f"{r['casts']} | {r['cosine']:.6f} | {r['max abs']:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
