"""Deliberately broken pass steps for tests/optimize (run in the pass child process)."""

from __future__ import annotations

import os
import time
from typing import Any

import onnx


def wrong_pass(src: str, dst: str) -> dict[str, Any]:
    """Turns every Add into Sub and every Relu into Abs: a pass that miscompiles."""
    proto = onnx.load(src)
    for n in proto.graph.node:
        n.op_type = {"Add": "Sub", "Relu": "Abs"}.get(n.op_type, n.op_type)
    onnx.save(proto, dst)
    return {}


def littering_pass(src: str, dst: str) -> dict[str, Any]:
    """Copies the model, leaving a dump in the working directory as ONNX Runtime's symbolic
    shape inference does when it is incomplete (sym_shape_infer_temp.onnx and a uuid-named
    .data file, both in the current directory)."""
    proto = onnx.load(src)
    onnx.save(proto, "sym_shape_infer_temp.onnx")
    onnx.save(proto, dst)
    return {"cwd": os.getcwd()}


def crashing_pass(src: str, dst: str) -> dict[str, Any]:
    os.abort()


def hanging_pass(src: str, dst: str) -> dict[str, Any]:
    time.sleep(3600)
    return {}


def subtle_pass(src: str, dst: str) -> dict[str, Any]:
    """Scales the largest weight's elements by 1 +/- 1e-3: a miscompile far below the old fixed
    tolerance's reach on a deep model, well above float32 rounding."""
    from onnxmedic.verify.faults import scale_weight

    onnx.save(scale_weight(onnx.load(src), 1e-3), dst)
    return {}


def corrupt_nbits_blocks(src: str, dst: str) -> dict[str, Any]:
    """After the weight-only quantizer: sets the first block of the first 8 columns of every
    MatMulNBits weight to the largest code (a garbled stretch of a quantized file). One block
    alone was too little: the search on the whole model found the file within the budget with
    the last layer float32, the other five corrupted blocks included."""
    import numpy as np
    from onnx import numpy_helper

    proto = onnx.load(src)
    inits = {t.name: t for t in proto.graph.initializer}
    hit = 0
    for n in proto.graph.node:
        if n.op_type == "MatMulNBits":
            t = inits[n.input[1]]
            q = numpy_helper.to_array(t).copy()  # (N, K blocks, block bytes) uint8
            q[:8, 0, :] = np.uint8(255)
            t.CopyFrom(numpy_helper.from_array(q, t.name))
            hit += 1
    onnx.save(proto, dst)
    return {"corrupted": hit}


def _lookup(table: dict[str, int], key: str) -> int:
    return table[key]


def raising_pass(src: str, dst: str) -> dict[str, Any]:
    """Raises from a helper, as a library's pass does from deep inside it."""
    return {"n": _lookup({}, "heads")}


def modules_pass(src: str, dst: str) -> dict[str, Any]:
    """Copies the model and says which heavy modules the pass child had imported."""
    import sys

    onnx.save(onnx.load(src), dst)
    return {"imported": sorted(m for m in ("torch", "onnxmedic.api", "transformers")
                               if m in sys.modules)}


def misleading_gains(src: str, dst: str, feeds: str, quantized: str, cosine: float,
                     max_excluded: int | None = None, seconds: float = 300.0) -> dict[str, Any]:
    """int8.float_gains with its two best layers swapped and one layer predicted to do: a
    prediction the verification sets then refute."""
    from onnxmedic.optimize import int8

    out = int8.float_gains(src, dst, feeds, quantized, cosine, max_excluded, seconds)
    gains = out["errors"]
    first, second = sorted(gains, key=lambda n: -gains[n])[:2]
    gains[first], gains[second] = gains[second], gains[first]
    out["predicted"] = 1
    return out



def misleading_amplifiers(src: str, dst: str, feeds: str, float16: str,
                          **kw: Any) -> dict[str, Any]:
    """fp16.amplifiers ranking only the first Gemm (a layer float16 computes well): a
    block list that cannot reach the budget."""
    import onnx

    from onnxmedic.optimize import fp16

    out = fp16.amplifiers(src, dst, feeds, float16, **kw)
    gemm = sorted(n.name for n in onnx.load(src).graph.node if n.op_type == "Gemm")[0]
    out["ranked"] = [{"node": gemm, "added": 1.0, "output_err": 1.0, "input_err": 0.0,
                      "keep": [gemm]}]
    return out


def no_amplifiers(src: str, dst: str, feeds: str, float16: str, **kw: Any) -> dict[str, Any]:
    """fp16.amplifiers finding no node that adds float16 error."""
    from onnxmedic.optimize import fp16

    return {**fp16.amplifiers(src, dst, feeds, float16, **kw), "ranked": []}
