"""onnxscript's optimizer on the 0.5 B decoder's graph (the generation package's, translated
once per run) with its own SlicesSplit matcher and with rewrite_speed.sibling_slices: seconds,
and whether the two optimized graphs are the same (ops and inputs, node by node).

    python bench/optimize/slices_split.py /work/coord/models/qwen2-0.5b

About 3 minutes and 5 GiB: run it through the shared lock.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from transformers import AutoModelForCausalLM  # noqa: E402

from onnxmedic._torch_compat import core_export, default_opset  # noqa: E402
from onnxmedic.hf import generation  # noqa: E402
from onnxmedic.rewrite_speed import sibling_slices  # noqa: E402
from onnxmedic.stages.translate import onnx_registry_plain  # noqa: E402


def main() -> None:
    m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    args, shapes = generation.example_step(m)[:2]
    dec = generation.GenerationDecoder(m).eval()
    ep = torch.export.export(dec, args, dynamic_shapes=shapes, strict=False)
    opset = default_opset()
    reg = onnx_registry_plain(opset)
    graphs = {}
    for fast in (False, True):
        prog = core_export(ep, args, None, registry=reg, opset=opset, optimize=False)
        t = time.perf_counter()
        with sibling_slices() if fast else contextlib.nullcontext():
            prog.optimize()
        dt = time.perf_counter() - t
        graphs[fast] = [(n.op_type, [i.name if i else "" for i in n.inputs])
                        for n in prog.model.graph]
        print(f"{'sibling_slices' if fast else 'onnxscript'}: optimize {dt:.1f} s, "
              f"{len(graphs[fast])} nodes", flush=True)
        del prog
    print("same graph:", graphs[False] == graphs[True])


if __name__ == "__main__":
    main()
