"""Small helpers shared by the translation families (traced ONNX Script functions)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

FLOAT_DTYPES = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def const(value: Any, like: Any) -> Any:
    """A constant with ``like``'s element type (a float32 constant cast like the input)."""
    if isinstance(value, bool):
        return op.CastLike(op.Constant(value_int=int(value)), like)
    if isinstance(value, int):
        return op.CastLike(op.Constant(value_int=value), like)
    return op.CastLike(op.Constant(value_float=float(value)), like)


def const_f64(value: float, like: Any) -> Any:
    """Like :func:`const` but exact for float64 inputs (the constant is stored as double)."""
    return op.CastLike(op.Constant(value=ir.tensor(np.array(value, dtype=np.float64))), like)


def ints(values: list[int] | tuple[int, ...]) -> Any:
    """A 1-D int64 constant (for shapes, axes, indices)."""
    return op.Constant(value_ints=list(values))


def static_shape(x: Any) -> tuple[int, ...] | None:
    """The input's shape if every dim is known at export time, else None."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    dims = []
    for d in shape:
        if not isinstance(d, int):
            return None
        dims.append(d)
    return tuple(dims)


def is_float(x: Any) -> bool:
    return getattr(x, "dtype", None) in FLOAT_DTYPES


def rank(x: Any) -> int:
    """The (static) rank of an ONNX Script value."""
    return len(x.shape)


def norm_axis(dim: int, rank: int) -> int:
    """``dim`` as a non-negative axis of a tensor of ``rank`` (0-d tensors take dim 0 / -1)."""
    r = max(rank, 1)
    if not -r <= dim < r:
        raise ValueError(f"dim {dim} is out of range for a tensor of rank {rank}")
    return dim + r if dim < 0 else dim


def add_fake_kernel(qualname: str, kernel: Any) -> bool:
    """Put ``kernel`` in torch's fake-impl registry for ``qualname`` (e.g. "aten::_ctc_loss").

    For ATen ops tagged ``dynamic_output_shape`` that have no fake kernel: FakeTensorMode refuses
    them (DynamicOutputShapeException) before any translation is consulted, so torch.export
    cannot capture them. The fake-impl registry is consulted before that refusal and adds no
    Meta registration, so nothing else changes. The kernel may raise to refuse a case whose
    shapes really are data dependent. Added once (idempotent). Private torch API: returns False
    if it moved, and the op simply stays uncapturable, as before."""
    from onnxmedic._torch_compat import add_fake_kernel as add

    return add(qualname, kernel)
