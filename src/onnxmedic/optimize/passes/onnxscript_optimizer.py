"""The onnxscript optimizer pass (the "onnxscript-optimize" candidate, and the first step of the
fp16 and int8 ones): constant folding, common subexpressions, dead code, function inlining.
Its step is named ``onnxmedic.optimize.passes:onnxscript_optimize``; its test is
tests/optimize/passes/test_onnxscript_optimizer.py."""

from __future__ import annotations

from typing import Any

from onnxmedic.optimize.files import load_ir, op_count_diff, op_counts, save_ir
from onnxmedic.rewrite_speed import sibling_slices


def onnxscript_optimize(src: str, dst: str) -> dict[str, Any]:
    """onnxscript.optimizer.optimize: constant folding, common-subexpression and dead-code
    elimination, function inlining. Standard ONNX ops only (portable to every runtime)."""
    import onnxscript.optimizer

    before = op_counts(src)
    model = load_ir(src)
    with sibling_slices():  # the same graph, sooner (rewrite_speed.py)
        onnxscript.optimizer.optimize(model)
    save_ir(model, dst)
    return op_count_diff(before, op_counts(dst))
