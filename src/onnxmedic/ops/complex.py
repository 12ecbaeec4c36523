"""Complex-valued inputs of ops torchlib translates only for real ones.

torch.onnx represents a complex tensor of shape ``S`` as a real tensor of shape ``S + [2]``
(real, imag in a trailing dim) and dispatches a node with a complex input only to translations
marked complex (torchlib's ``complex=True``); torchlib marks about thirty (add, mul.Tensor,
matmul, permute, slice, cat, fft ...). Without one here, the export fails with "No
decompositions registered for the complex-valued input".

Two kinds of op are covered:

* structural ops (select, unsqueeze, select_scatter, slice_scatter, where, copy): the real
  translation of torchlib on the ``S + [2]`` tensor, with a negative ``dim`` moved one to the
  left past the trailing (real, imag) dim and a boolean condition given a trailing dim of 1;
* arithmetic with a Python scalar (mul.Scalar): PyTorch turns the scalar into ``c + d i`` (a
  real one into ``c + 0i``) and multiplies as complex numbers, so ``inf * 2`` gives
  ``inf + nan i`` as in PyTorch; torchlib's complex product of two tensors does the same.

Dtype conversions of a complex tensor (_to_copy, prims.convert_element_type) cast the pair to
the real counterpart of a complex target, or keep the real part for a real target (PyTorch's
discarding cast).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op
from onnxscript.function_libs.torch_lib.ops import common as tl_common
from onnxscript.function_libs.torch_lib.ops import core as tl

from onnxmedic.ops._registry import translation

aten = torch.ops.aten
prims = torch.ops.prims

_REAL_OF = {ir.DataType.COMPLEX64: ir.DataType.FLOAT, ir.DataType.COMPLEX128: ir.DataType.DOUBLE}


def _dim(dim: int) -> int:
    """A dim of the complex tensor as a dim of its real ``S + [2]`` representation."""
    return dim - 1 if dim < 0 else dim


@translation(aten.mul.Scalar, complex=True)
def aten_mul_scalar_complex(self, other):
    """mul.Scalar(Tensor self, Scalar other) -> Tensor

    ``(a + b i)(c + d i) = (ac - bd) + (ad + bc) i`` with the scalar as the constant ``[c, d]``
    (torchlib's complex product, broadcast over the tensor)."""
    value = complex(other)
    pair = op.Constant(value=ir.tensor(np.array([value.real, value.imag],
                                                dtype=self.dtype.numpy())))
    return tl.aten_mul_complex(self, pair)


@translation(aten.select.int, complex=True)
def aten_select_int_complex(self, dim: int, index: int):
    """select.int(Tensor(a) self, int dim, SymInt index) -> Tensor(a)"""
    return tl.aten_select(self, _dim(dim), index)


@translation(aten.unsqueeze.default, complex=True)
def aten_unsqueeze_complex(self, dim: int):
    """unsqueeze(Tensor(a) self, int dim) -> Tensor(a)"""
    return tl.aten_unsqueeze(self, _dim(dim))


@translation(aten.select_scatter.default, complex=True)
def aten_select_scatter_complex(self, src, dim: int, index: int):
    """select_scatter(Tensor self, Tensor src, int dim, SymInt index) -> Tensor"""
    return tl.aten_select_scatter(self, src, _dim(dim), index)


@translation(aten.slice_scatter.default, complex=True)
def aten_slice_scatter_complex(self, src, dim: int = 0, start=None, end=None, step=1):
    """slice_scatter(Tensor self, Tensor src, int dim=0, SymInt? start=None, SymInt? end=None,
    SymInt step=1) -> Tensor"""
    rank = len(self.shape) - 1
    return tl.aten_slice_scatter(self, src, dim + rank if dim < 0 else dim, start, end, step)


@translation(aten.where.self, complex=True)
def aten_where_self_complex(condition, self, other):
    """where.self(Tensor condition, Tensor self, Tensor other) -> Tensor

    The condition (boolean, never complex) gets a trailing dim of 1 so that it broadcasts
    over (real, imag)."""
    return tl.aten_where(op.Unsqueeze(condition, [-1]), self, other)


@translation(aten.copy.default, complex=True)
def aten_copy_complex(self, src, non_blocking: bool = False):
    """copy(Tensor self, Tensor src, bool non_blocking=False) -> Tensor

    ``src`` broadcast to ``self``'s shape, in its dtype."""
    return op.Expand(op.CastLike(src, self), op.Shape(self))


def _convert_complex(self, dtype: int):
    if dtype in (-1, None):
        return op.Identity(self)
    real = _REAL_OF.get(ir.DataType(dtype))
    if real is not None:  # complex -> complex: cast the (real, imag) pairs
        return op.Cast(self, to=real)
    # complex -> real: PyTorch keeps the real part
    return tl_common.cast_to(op.Squeeze(op.Slice(self, [0], [1], [-1]), [-1]), dtype)


@translation(aten._to_copy.default, complex=True)
def aten__to_copy_complex(self, dtype: int = -1, layout: str = "", device: str = "",
                          pin_memory: bool = False, non_blocking: bool = False,
                          memory_format: str = ""):
    """_to_copy(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None,
    bool? pin_memory=None, bool non_blocking=False, MemoryFormat? memory_format=None) -> Tensor"""
    return _convert_complex(self, dtype)


@translation(prims.convert_element_type.default, complex=True)
def prims_convert_element_type_complex(a, dtype: int):
    """convert_element_type(Tensor a, ScalarType dtype) -> Tensor"""
    return _convert_complex(a, dtype)


def _fill_like(self, value, dtype):
    """A tensor of ``self``'s (complex) shape filled with ``value``, in ``dtype`` (-1: a complex
    result like ``self``; a real dtype: the shape without the (real, imag) dim)."""
    value = complex(value)
    if dtype in (-1, None) or ir.DataType(dtype) in _REAL_OF:
        real = self.dtype if dtype in (-1, None) else _REAL_OF[ir.DataType(dtype)]
        pair = op.Constant(value=ir.tensor(np.array([value.real, value.imag],
                                                    dtype=real.numpy())))
        return op.Expand(pair, op.Shape(self))
    # a real result: PyTorch keeps the real part of the fill value
    fill = op.Cast(op.Constant(value=ir.tensor(np.array(value.real, dtype=np.float64))),
                   to=dtype)
    return op.Expand(fill, op.Shape(self, end=-1))


@translation(aten.zeros_like.default, complex=True)
def aten_zeros_like_complex(self, dtype: int = -1, layout: str = "", device: str = "",
                            pin_memory: bool = False, memory_format: str = ""):
    """zeros_like(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None,
    bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor"""
    return _fill_like(self, 0, dtype)


@translation(aten.ones_like.default, complex=True)
def aten_ones_like_complex(self, dtype: int = -1, layout: str = "", device: str = "",
                           pin_memory: bool = False, memory_format: str = ""):
    """ones_like(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None,
    bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor"""
    return _fill_like(self, 1, dtype)


@translation(aten.full_like.default, complex=True)
def aten_full_like_complex(self, fill_value, dtype: int = -1, layout: str = "", device: str = "",
                           pin_memory: bool = False, memory_format: str = ""):
    """full_like(Tensor self, Scalar fill_value, *, ScalarType? dtype=None, Layout? layout=None,
    Device? device=None, bool? pin_memory=None, MemoryFormat? memory_format=None) -> Tensor"""
    return _fill_like(self, fill_value, dtype)


# ---------------------------------------------------------------- complex values made from real
# A node whose inputs are all real (or Python numbers) goes to the real translation even when it
# makes a complex tensor: torchlib's then builds an ONNX complex tensor (zeros(..., dtype=
# complex128)), or a wrong rank (stack of a real and a complex tensor), that the next complex
# translation cannot read. These real translations do what torchlib does, except for complex.

def _complex_dtype(dtype) -> ir.DataType | None:
    """The real dtype of the (real, imag) pairs when ``dtype`` is complex, else None."""
    if dtype in (-1, None):
        return None
    return _REAL_OF.get(ir.DataType(dtype))


def _pair(value, real: ir.DataType):
    value = complex(value)
    return op.Constant(value=ir.tensor(np.array([value.real, value.imag], dtype=real.numpy())))


def _full_complex(size, value, real: ir.DataType):
    shape = op.Concat(op.Cast(tl_common.merge_dims(size), to=ir.DataType.INT64),
                      op.Constant(value_ints=[2]), axis=0)
    return op.Expand(_pair(value, real), shape)


@translation(aten.zeros.default, overrides_torchlib=True,
             note="complex dtypes: torchlib makes an ONNX complex tensor")
def aten_zeros(size, dtype: int = ir.DataType.FLOAT, layout: str = "", device: str = "",
               pin_memory: bool = False):
    """zeros(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None,
    bool? pin_memory=None) -> Tensor"""
    real = _complex_dtype(dtype)
    if real is None:
        return tl.aten_zeros(size, dtype, layout, device, pin_memory)
    return _full_complex(size, 0, real)


@translation(aten.ones.default, overrides_torchlib=True,
             note="complex dtypes: torchlib makes an ONNX complex tensor")
def aten_ones(size, dtype: int = -1, layout: str = "", device: str = "",
              pin_memory: bool = False):
    """ones(SymInt[] size, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None,
    bool? pin_memory=None) -> Tensor"""
    real = _complex_dtype(dtype)
    if real is None:
        return tl.aten_ones(size, dtype, layout, device, pin_memory)
    return _full_complex(size, 1, real)


@translation(aten.full.default, overrides_torchlib=True,
             note="complex dtypes: torchlib makes an ONNX complex tensor")
def aten_full(size, fill_value, dtype: int = -1, layout: str = "", device: str = "",
              pin_memory: bool = False):
    """full(SymInt[] size, Scalar fill_value, *, ScalarType? dtype=None, Layout? layout=None,
    Device? device=None, bool? pin_memory=None) -> Tensor"""
    real = _complex_dtype(dtype)
    if real is None and dtype in (-1, None) and isinstance(fill_value, complex):
        real = ir.DataType.FLOAT  # a complex fill value makes the default complex dtype
    if real is None or not isinstance(fill_value, (int, float, complex)):
        return tl.aten_full(size, fill_value, dtype, layout, device, pin_memory)
    return _full_complex(size, fill_value, real)


@translation(aten.scalar_tensor.default, overrides_torchlib=True,
             note="complex dtypes: torchlib makes an ONNX complex tensor")
def aten_scalar_tensor(s, dtype: int = ir.DataType.FLOAT, layout: str = "", device: str = "",
                       pin_memory: bool = False):
    """scalar_tensor(Scalar s, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None,
    bool? pin_memory=None) -> Tensor"""
    real = _complex_dtype(dtype)
    if real is None or not isinstance(s, (int, float, complex)):
        return tl.aten_scalar_tensor(s, dtype, layout, device, pin_memory)
    return _pair(s, real)


def _as_complex(tensors):
    """Real tensors among complex ones (a rank less: the inputs of stack/cat have one rank)
    made complex with a zero imaginary part, all in one real dtype (float64 when any is)."""
    rank = max(len(t.shape) for t in tensors)
    dtypes = {t.dtype for t in tensors if len(t.shape) == rank}
    real = ir.DataType.DOUBLE if ir.DataType.DOUBLE in {t.dtype for t in tensors} | dtypes \
        else next(iter(dtypes))
    out = []
    for t in tensors:
        is_real = len(t.shape) < rank
        t = t if t.dtype == real else op.Cast(t, to=real)
        if is_real:
            t = tl_common.cast_to(t, ir.DataType.COMPLEX128 if real == ir.DataType.DOUBLE
                                  else ir.DataType.COMPLEX64)
        out.append(t)
    return out


@translation(aten.stack.default, complex=True, overrides_torchlib=True,
             note="a real tensor among the complex ones (PyTorch promotes it)")
def aten_stack_complex(tensors, dim: int = 0):
    """stack(Tensor[] tensors, int dim=0) -> Tensor"""
    return tl.aten_stack(_as_complex(tensors), _dim(dim))


@translation(aten.cat.default, complex=True, overrides_torchlib=True,
             note="a real tensor among the complex ones (PyTorch promotes it)")
def aten_cat_complex(tensors, dim: int = 0):
    """cat(Tensor[] tensors, int dim=0) -> Tensor"""
    return tl.aten_cat(_as_complex(tensors), _dim(dim))


@translation(aten.einsum.default, complex=True)
def aten_einsum_complex(equation: str, tensors, path=None):
    """einsum(str equation, Tensor[] tensors, *, int[]? path=None) -> Tensor

    The product of complex operands expanded into real einsums of their real and imaginary
    parts, e.g. ``A B = (Ar Br - Ai Bi) + (Ar Bi + Ai Br) i``: each term picks one part per
    operand, adds to the real result when it picks an even number of imaginary parts (sign
    ``(-1)^(k/2)``), else to the imaginary one. The terms are those of PyTorch's complex
    products, so an infinite part gives inf as in PyTorch, not the ``inf * 0 = nan`` a
    product by a constant 2x2x2 tensor would. An operand whose rank is its subscript's
    (without an ellipsis) is real and contributes its real part only. 2^n einsums for n
    complex operands (einsum calls rarely have more than three)."""
    import itertools

    lhs = equation.replace(" ", "").partition("->")[0]
    subs = lhs.split(",")
    real = ir.DataType.DOUBLE if any(t.dtype == ir.DataType.DOUBLE for t in tensors) \
        else ir.DataType.FLOAT
    parts = []  # per operand: (real part, imaginary part or None)
    for sub, t in zip(subs, tensors):
        t = t if t.dtype == real else op.Cast(t, to=real)
        if "..." in sub or len(t.shape) == len(sub) + 1:
            parts.append((op.Gather(t, op.Constant(value_int=0), axis=-1),
                          op.Gather(t, op.Constant(value_int=1), axis=-1)))
        else:
            parts.append((t, None))
    sums = {0: None, 1: None}  # 0: real, 1: imaginary
    for picks in itertools.product((0, 1), repeat=len(parts)):
        if any(p == 1 and im is None for p, (_, im) in zip(picks, parts)):
            continue
        term = op.Einsum(*[pair[p] for p, pair in zip(picks, parts)], equation=equation)
        k = sum(picks)
        negative = (k // 2) % 2 == 1
        acc = sums[k % 2]
        if acc is None:
            sums[k % 2] = op.Neg(term) if negative else term
        else:
            sums[k % 2] = op.Sub(acc, term) if negative else op.Add(acc, term)
    re = sums[0]
    im = sums[1] if sums[1] is not None else op.Sub(re, re)  # all-real operands (not dispatched)
    return op.Concat(op.Unsqueeze(re, [-1]), op.Unsqueeze(im, [-1]), axis=-1)


def _roll_along(x, shift, axis: int):
    """``x`` rolled by ``shift`` along the non-negative ``axis``: the last ``shift mod n``
    entries moved to the front (torchlib's Slice/Concat). ``shift`` is an int or a 0-d INT64
    value - a symbolic size (``torch.fft.fftshift`` of a dynamic dim rolls by ``n // 2``),
    where torchlib puts the shift in a constant and fails. An empty dim has nothing to move
    (the Mod divides by at least 1)."""
    n = op.Shape(x, start=axis, end=axis + 1)
    neg = (op.Constant(value_ints=[-shift]) if isinstance(shift, int)
           else op.Neg(op.Reshape(op.Cast(shift, to=ir.DataType.INT64),
                                  op.Constant(value_ints=[1]))))
    k = op.Mod(neg, op.Max(n, op.Constant(value_ints=[1])))
    axes = op.Constant(value_ints=[axis])
    return op.Concat(op.Slice(x, k, n, axes), op.Slice(x, op.Constant(value_ints=[0]), k, axes),
                     axis=axis)


def _roll(self, shifts, dims, rank: int, keep: list[int]):
    """roll over the first ``rank`` dims of ``self``; ``keep``: the trailing shape kept whole
    when there are no dims (``[2]`` for a complex pair, ``[]`` otherwise)."""
    shifts = [shifts] if not isinstance(shifts, (list, tuple)) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if not dims:
        if len(shifts) != 1:
            raise ValueError("roll: shifts must be a single value when dims is empty")
        flat = op.Reshape(self, op.Constant(value_ints=[-1, *keep]))
        return op.Reshape(_roll_along(flat, shifts[0], 0), op.Shape(self), allowzero=True)
    if len(shifts) != len(dims):
        raise ValueError(f"roll: {len(shifts)} shifts for {len(dims)} dims")
    out = self
    for shift, dim in zip(shifts, dims, strict=True):
        if not -rank <= dim < rank:
            raise ValueError(f"roll: dim {dim} out of range for a {rank}-d tensor")
        out = _roll_along(out, shift, dim % rank)
    return out


@translation(aten.roll.default, overrides_torchlib=True,
             note="symbolic shifts: torchlib puts the shift in a constant")
def aten_roll(self, shifts, dims=()):
    """roll(Tensor self, SymInt[1] shifts, int[1] dims=[]) -> Tensor"""
    rank = len(self.shape) if self.shape is not None else None
    if rank == 0:
        return op.Identity(self)
    if rank is None:
        return tl.aten_roll(self, shifts, dims)
    return _roll(self, shifts, dims, rank, [])


@translation(aten.roll.default, complex=True, overrides_torchlib=True,
             note="symbolic shifts: torchlib puts the shift in a constant")
def aten_roll_complex(self, shifts, dims=()):
    """roll(Tensor self, SymInt[1] shifts, int[1] dims=[]) -> Tensor

    The (real, imag) pair moves as one: the roll is over the dims before the trailing one."""
    rank = len(self.shape) - 1 if self.shape is not None else None
    if rank == 0:
        return op.Identity(self)
    if rank is None:
        return tl.aten_roll_complex(self, shifts, dims)
    return _roll(self, shifts, dims, rank, [2])
