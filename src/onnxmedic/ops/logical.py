"""Logical reductions: aten._is_all_true / aten._is_any_true.

``torch._assert_async`` and validation code (pyro's multivariate Student-t, torch.distributions
constraints) reduce a bool tensor to a 0-d bool with these; torchlib has no translation.
"""

from __future__ import annotations

import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._registry import translation

aten = torch.ops.aten


@translation(aten._is_all_true.default)
def aten__is_all_true(self):
    """_is_all_true(Tensor self) -> Tensor

    A 0-d bool: True when every element is true (also for an empty tensor)."""
    x = op.Cast(op.Reshape(self, op.Constant(value_ints=[-1])), to=ir.DataType.INT64)
    # ReduceMin of an empty tensor is +max in ONNX: pad with one 1 so that all([]) is True
    x = op.Concat(x, op.Constant(value_ints=[1]), axis=0)
    return op.Cast(op.ReduceMin(x, keepdims=0), to=ir.DataType.BOOL)


@translation(aten._is_any_true.default)
def aten__is_any_true(self):
    """_is_any_true(Tensor self) -> Tensor

    A 0-d bool: True when some element is true (False for an empty tensor)."""
    x = op.Cast(op.Reshape(self, op.Constant(value_ints=[-1])), to=ir.DataType.INT64)
    x = op.Concat(x, op.Constant(value_ints=[0]), axis=0)
    return op.Cast(op.ReduceMax(x, keepdims=0), to=ir.DataType.BOOL)
