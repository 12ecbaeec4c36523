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
