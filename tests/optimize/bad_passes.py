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
