"""Ops torchlib translates *silently wrong*: the model exports and runs, the numbers are wrong.

Found by the OpInfo coverage harness (bench/peers/opinfo_coverage.py, "silent mismatch" column) and
listed in docs/miscompiles.md with the inputs that show each one. Every translation here
replaces torchlib's (``overrides_torchlib=True``); tests/ops/test_miscompiles.py proves both
that torchlib's result is wrong and that this one matches PyTorch.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import FLOAT_DTYPES, const, ints, static_shape
from onnxmedic.ops._registry import translation

aten = torch.ops.aten

_REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _filled_like(value, like):
    """A tensor of ``like``'s shape and type filled with ``value``."""
    return op.Expand(const(value, like), op.Shape(like))


def _extreme(like, dtype, lowest: bool):
    """-inf / +inf for floats, the type's min / max for integers (amax / amin's identity)."""
    if dtype in FLOAT_DTYPES or dtype is None:
        return const(float("-inf") if lowest else float("inf"), like)
    if dtype == ir.DataType.BOOL:
        return const(not lowest, like)
    info = np.iinfo(dtype.numpy())
    value = info.min if lowest else info.max
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


@translation(aten.scatter_reduce.two, overrides_torchlib=True)
def aten_scatter_reduce_two(self, dim: int, index, src, reduce: str, include_self: bool = True):
    """scatter_reduce.two(Tensor self, int dim, Tensor index, Tensor src, str reduce, *, bool include_self=True) -> Tensor

    torchlib maps ``reduce="mean"`` to ScatterElements(reduction="none") (last write wins, no
    average), makes amax/amin with ``include_self=False`` start from the largest finite value
    instead of -inf/+inf (an all -inf group gives -3.4e38), and drops NaNs in amax/amin (ONNX
    Runtime's max/min reductions keep the other operand). Here: mean = scatter-add of the
    values divided by a scatter-add of counts (floor division for integers, like PyTorch);
    amax/amin start from -inf/+inf and a scatter-max of ``isnan`` puts NaN back wherever
    PyTorch propagates it; ``src`` is cut to ``index``'s shape (PyTorch reads only that part).
    """
    if reduce not in _REDUCTIONS:
        raise ValueError(f"scatter_reduce: unknown reduce={reduce!r} (expected one of "
                         f"{', '.join(_REDUCTIONS)})")
    dtype = self.dtype  # read before the reshapes below: traced values may lose it
    is_float = dtype in FLOAT_DTYPES
    self_shape = static_shape(self)
    src_shape, index_shape = static_shape(src), static_shape(index)
    scalar = self_shape is not None and len(self_shape) == 0
    rank = 1 if scalar else len(index.shape)
    if scalar:  # ScatterElements needs rank >= 1
        flat = ints([-1])
        out_shape = op.Shape(self)
        self, index, src = op.Reshape(self, flat), op.Reshape(index, flat), op.Reshape(src, flat)
    if src_shape is None or index_shape is None or src_shape != index_shape:
        src = op.Slice(src, ints([0] * rank), op.Shape(index), ints(list(range(rank))))

    def scatter(data, updates, reduction):
        return op.ScatterElements(data, index, updates, axis=dim, reduction=reduction)

    if reduce in ("sum", "prod", "mean"):
        identity = 1 if reduce == "prod" else 0
        base = self if include_self else scatter(self, _filled_like(identity, src), "none")
        result = scatter(base, src, "mul" if reduce == "prod" else "add")
        if reduce == "mean":
            one = const(1, self)
            counts0 = _filled_like(1 if include_self else 0, self)
            counts = op.Max(scatter(counts0, _filled_like(1, src), "add"), one)
            if is_float:
                result = op.Div(result, counts)
            else:  # floor division like PyTorch (counts > 0, so Mod has the divisor's sign)
                result = op.Div(op.Sub(result, op.Mod(result, counts)), counts)
    else:
        lowest = reduce == "amax"
        base = self if include_self else scatter(
            self, op.Expand(_extreme(src, dtype, lowest), op.Shape(src)), "none")
        result = scatter(base, src, "max" if lowest else "min")
        if is_float:
            nan_self = op.Cast(op.IsNaN(self), to=ir.DataType.FLOAT)
            if not include_self:  # the scattered positions forget self's value
                nan_self = scatter(nan_self, op.Expand(op.Constant(value_float=0.0),
                                                       op.Shape(src)), "none")
            has_nan = scatter(nan_self, op.Cast(op.IsNaN(src), to=ir.DataType.FLOAT), "max")
            result = op.Where(op.Greater(has_nan, op.Constant(value_float=0.0)),
                              const(float("nan"), result), result)
    if scalar:
        result = op.Reshape(result, out_shape)
    return result


@translation(aten.copy.default, overrides_torchlib=True)
def aten_copy(self, src, non_blocking: bool = False):
    """copy(Tensor self, Tensor src, bool non_blocking=False) -> Tensor

    The result has ``self``'s shape and dtype with ``src`` broadcast into it. torchlib returns
    ``CastLike(src, self)``, i.e. ``src``'s shape: a 0-d or size-1 ``src`` copied into a larger
    ``self`` comes out with the wrong shape. torch's own decompositions emit this op, e.g.
    ``torch.linspace(start_tensor, end_tensor, steps=1)`` (and logspace) gives shape [] instead
    of [1]; ``buffer.copy_(scalar_tensor)`` in a module does the same.
    """
    return op.Expand(op.CastLike(src, self), op.Shape(self))


@translation(aten._native_batch_norm_legit_functional.default, overrides_torchlib=True)
def aten__native_batch_norm_legit_functional(
    input, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float
):
    """_native_batch_norm_legit_functional(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor, Tensor running_mean_out, Tensor running_var_out)

    torch.onnx lowers every training-mode batch norm (``F.batch_norm(training=True)``, a
    BatchNorm module exported in train mode, ``torch.native_batch_norm``) to this op. torchlib
    hard-codes ``training = False`` ("temporary fix") and normalises with the *running*
    statistics: every output element is wrong. Here, in training mode the batch mean and biased
    variance over all dims but 1 normalise the input; ``save_mean``/``save_rstd`` are the batch
    statistics and the running statistics are updated with ``momentum`` (unbiased variance),
    like PyTorch.
    """
    rank = len(input.shape)
    axes = ints([a for a in range(rank) if a != 1])
    bshape = [1] * rank
    bshape[1] = -1
    to_b = ints(bshape)
    eps_c = const(eps, input)
    if training:
        mean_k = op.ReduceMean(input, axes, keepdims=1)
        centered = op.Sub(input, mean_k)
        var_k = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=1)
        rstd_k = op.Reciprocal(op.Sqrt(op.Add(var_k, eps_c)))
        out = op.Mul(centered, rstd_k)
        save_mean = op.Reshape(mean_k, ints([-1]))
        save_rstd = op.Reshape(rstd_k, ints([-1]))
        # unbiased variance for the running estimate: var * n / (n - 1)
        n = op.CastLike(op.ReduceProd(op.Gather(op.Shape(input), axes), keepdims=0), input)
        var_u = op.Div(op.Mul(op.Reshape(var_k, ints([-1])), n), op.Sub(n, const(1.0, input)))
        m = const(momentum, input)
        keep = const(1.0 - momentum, input)
        new_mean = op.Add(op.Mul(keep, running_mean), op.Mul(m, save_mean))
        new_var = op.Add(op.Mul(keep, running_var), op.Mul(m, var_u))
    else:
        rstd = op.Reciprocal(op.Sqrt(op.Add(running_var, eps_c)))
        out = op.Mul(op.Sub(input, op.Reshape(running_mean, to_b)), op.Reshape(rstd, to_b))
        save_mean = op.Slice(running_mean, ints([0]), ints([0]))  # empty, as on CPU
        save_rstd = op.Slice(running_var, ints([0]), ints([0]))
        new_mean, new_var = op.Identity(running_mean), op.Identity(running_var)
    if weight is not None:
        out = op.Mul(out, op.Reshape(weight, to_b))
    if bias is not None:
        out = op.Add(out, op.Reshape(bias, to_b))
    return out, save_mean, save_rstd, new_mean, new_var


# ----------------------------------------------------------------- reductions over empty sets
# torchlib lowers mean/var/std to ReduceMean, which ONNX Runtime evaluates to 0 over an empty
# set; PyTorch's mean of nothing is NaN (0/0), and so are var/std. Sum / count keeps the 0/0.


def _axes_and_count(x, dim):
    """(axes constant or None for all, number of reduced elements as x's dtype)."""
    if dim is None or len(dim) == 0 or static_shape(x) == ():  # 0-d: dim 0 / -1 is itself
        return None, op.CastLike(op.Size(x), x)
    axes = ints(list(dim))
    return axes, op.CastLike(op.ReduceProd(op.Gather(op.Shape(x), axes), keepdims=0), x)


def _sum(x, axes, keepdim: bool):
    if axes is None:
        return op.ReduceSum(x, keepdims=1 if keepdim else 0)
    return op.ReduceSum(x, axes, keepdims=1 if keepdim else 0)


def _mean(x, dim, keepdim: bool):
    """ReduceMean (the op ONNX Runtime's RMSNorm / LayerNorm fusions look for), guarded to NaN
    when the reduced extent is empty; no guard when the shape proves it is not."""
    shape = static_shape(x)
    all_axes = dim is None or len(dim) == 0 or shape == ()
    k = 1 if keepdim else 0
    mean = (op.ReduceMean(x, keepdims=k) if all_axes
            else op.ReduceMean(x, ints(list(dim)), keepdims=k))
    if shape is not None:  # static: no guard when the reduced extent is provably non-empty
        reduced = range(len(shape)) if all_axes else [d % len(shape) for d in dim]
        if all(shape[d] > 0 for d in reduced):
            return mean
    _, n = _axes_and_count(x, dim)
    return op.Where(op.Equal(n, const(0.0, x)), const(float("nan"), x), mean)


def _var(x, dim, correction, keepdim: bool):
    axes, n = _axes_and_count(x, dim)
    mean = op.Div(_sum(x, axes, True), n)
    d = op.Sub(x, mean)
    c = 1.0 if correction is None else float(correction)
    dof = op.Max(op.Sub(n, const(c, x)), const(0.0, x))  # PyTorch: max(0, N - correction)
    return op.Div(_sum(op.Mul(d, d), axes, keepdim), dof), op.Div(_sum(x, axes, keepdim), n)


def _as(x, dtype):
    return x if dtype is None else op.Cast(x, to=dtype)


@translation(aten.mean.dim, overrides_torchlib=True)
def aten_mean_dim(self, dim=None, keepdim: bool = False, dtype: int | None = None):
    """mean.dim(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor"""
    return _mean(_as(self, dtype), dim, keepdim)


@translation(aten.mean.default, overrides_torchlib=True)
def aten_mean(self, dtype: int | None = None):
    """mean(Tensor self, *, ScalarType? dtype=None) -> Tensor"""
    return _mean(_as(self, dtype), None, False)


@translation(aten.var.correction, overrides_torchlib=True)
def aten_var_correction(self, dim=None, correction=None, keepdim: bool = False):
    """var.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor"""
    return _var(self, dim, correction, keepdim)[0]


@translation(aten.std.correction, overrides_torchlib=True)
def aten_std_correction(self, dim=None, correction=None, keepdim: bool = False):
    """std.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> Tensor"""
    return op.Sqrt(_var(self, dim, correction, keepdim)[0])


@translation(aten.var_mean.correction, overrides_torchlib=True)
def aten_var_mean_correction(self, dim=None, correction=None, keepdim: bool = False):
    """var_mean.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> (Tensor, Tensor)"""
    return _var(self, dim, correction, keepdim)


@translation(aten.std_mean.correction, overrides_torchlib=True)
def aten_std_mean_correction(self, dim=None, correction=None, keepdim: bool = False):
    """std_mean.correction(Tensor self, int[1]? dim=None, *, Scalar? correction=None, bool keepdim=False) -> (Tensor, Tensor)"""
    var, mean = _var(self, dim, correction, keepdim)
    return op.Sqrt(var), mean


@translation(aten._native_batch_norm_legit_no_training.default, overrides_torchlib=True)
def aten__native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var,
                                              momentum: float, eps: float):
    """_native_batch_norm_legit_no_training(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, float momentum, float eps) -> (Tensor, Tensor, Tensor)

    Eval-mode batch norm (every BatchNorm module in eval mode). The normalised output is ONNX's
    BatchNormalization, as in torchlib (ONNX Runtime fuses it into a preceding Conv); the
    second and third outputs are empty, as PyTorch returns them and as the exported program's
    own metadata says ([0]), where torchlib returned the running statistics ([C]): a shape
    that contradicts the program wherever they are used."""
    channels = op.Shape(input, start=1, end=2)
    if weight is None:
        weight = op.Expand(const(1.0, input), channels)
    if bias is None:
        bias = op.Expand(const(0.0, input), channels)
    out = op.BatchNormalization(input, weight, bias, running_mean, running_var, epsilon=eps,
                                training_mode=0)
    return (out, op.Slice(running_mean, ints([0]), ints([0])),
            op.Slice(running_var, ints([0]), ints([0])))


@translation(aten.log_sigmoid.default, overrides_torchlib=True)
def aten_log_sigmoid(self):
    """log_sigmoid(Tensor self) -> Tensor

    torchlib computes ``Log(Sigmoid(x))``: Sigmoid underflows to 0 below about -88 (float32), so
    ``F.logsigmoid(tensor(-100.))`` is -inf instead of -100, and near 1 ONNX Runtime's Sigmoid
    loses the small complement, so ``F.multilabel_soft_margin_loss`` on OpInfo's sample is off by
    1.5e-4 (eager float32: 3.5e-7 from the float64 value). PyTorch's formula instead:
    ``min(x, 0) - log1p(exp(-|x|))``, with an accurate log1p; NaN stays NaN, -inf gives -inf."""
    from onnxmedic.ops.cumulative import log1p_small

    neg = op.Where(op.Less(self, const(0.0, self)), self, const(0.0, self))
    return op.Sub(neg, log1p_small(op.Exp(op.Neg(op.Abs(self)))))


# ------------------------------------------------------------------- max/min reductions & NaN

def _reduce_extreme(self, dim, keepdim: bool, reduce):
    """ReduceMax/ReduceMin over ``dim`` (all dims when empty or None), NaN wherever the reduced
    set holds a NaN: PyTorch propagates NaN, ONNX Runtime's ReduceMax/ReduceMin skip it."""
    axes = None if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0) else (
        [dim] if isinstance(dim, int) else list(dim))
    keep = 1 if keepdim else 0
    shape = static_shape(self)
    if shape is not None and len(shape) == 0:
        return op.Identity(self)  # a 0-d input (PyTorch accepts dim 0 or -1 there): itself
    if axes is None:
        out = reduce(self, keepdims=keep)
    else:
        out = reduce(self, ints(axes), keepdims=keep)
    if getattr(self, "dtype", None) not in FLOAT_DTYPES:
        return out
    # the sum of the NaN elements only: NaN exactly where the reduced set holds one
    nans = op.Where(op.IsNaN(self), self, const(0.0, self))
    s = (op.ReduceSum(nans, keepdims=keep) if axes is None
         else op.ReduceSum(nans, ints(axes), keepdims=keep))
    return op.Where(op.IsNaN(s), s, out)


@translation(aten.max.default, overrides_torchlib=True)
def aten_max(self):
    """max(Tensor self) -> Tensor

    torchlib maps it to ReduceMax, which in ONNX Runtime skips NaN: ``torch.max(tensor([1.,
    nan, 3.]))`` is nan in PyTorch, 3 in ONNX Runtime. (``amax``/``amin`` have the same fault;
    overriding them changes how torch.onnx lowers float16 amax -- the output comes out float32
    -- so they are left to torchlib, see docs/miscompiles.md.)"""
    return _reduce_extreme(self, None, False, op.ReduceMax)


@translation(aten.min.default, overrides_torchlib=True)
def aten_min(self):
    """min(Tensor self) -> Tensor: NaN when any element is NaN, as in PyTorch (see max)."""
    return _reduce_extreme(self, None, False, op.ReduceMin)


@translation(aten.aminmax.default, overrides_torchlib=True)
def aten_aminmax(self, dim=None, keepdim: bool = False):
    """aminmax(Tensor self, *, int? dim=None, bool keepdim=False) -> (Tensor min, Tensor max)
    (torchlib requires ``dim``; NaN as in max)"""
    return (_reduce_extreme(self, dim, keepdim, op.ReduceMin),
            _reduce_extreme(self, dim, keepdim, op.ReduceMax))


@translation(aten.linalg_vector_norm.default, overrides_torchlib=True)
def aten_linalg_vector_norm(self, ord: float = 2.0, dim=None, keepdim: bool = False,
                            dtype: int = -1):
    """linalg_vector_norm(Tensor self, Scalar ord=2, int[1]? dim=None, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor

    A 0-d input with ``dim=0`` (or -1), which PyTorch treats as a 1-element vector
    (``F.cosine_similarity`` of two scalars does it): torchlib reduces over an axis the 0-d
    tensor does not have and ONNX Runtime rejects the model. Here it is reduced as the
    1-element vector it is; every other input goes to torchlib's translation unchanged."""
    from onnxscript.function_libs.torch_lib.ops.linalg import (
        aten_linalg_vector_norm as torchlib_norm,
    )

    shape = static_shape(self)
    if shape is not None and len(shape) == 0 and dim is not None:
        # a 0-d result either way: PyTorch keeps a 0-d input 0-d with keepdim too
        return torchlib_norm(op.Reshape(self, ints([1])), ord, [0], False, dtype)
    return torchlib_norm(self, ord, dim, keepdim, dtype)


# ------------------------------------------------------- attention: fully masked rows, any rank

def _torchlib_sdpa():
    from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

    fn = torchlib_nn.aten_scaled_dot_product_attention
    return getattr(fn, "function", fn)  # the traced function's Python body


def _fully_masked_rows(attn_mask, is_causal: bool):
    """A bool [..., L, 1] flag: the rows of ``attn_mask`` that mask every key (all False, or all
    -inf for an additive mask), or None when no row can be (no mask; a causal mask keeps the
    diagonal)."""
    if attn_mask is None or is_causal:
        return None
    axes = ints([-1])
    if attn_mask.dtype == ir.DataType.BOOL:
        any_kept = op.ReduceMax(op.Cast(attn_mask, to=ir.DataType.INT32), axes, keepdims=1)
        return op.Not(op.Cast(any_kept, to=ir.DataType.BOOL))
    return op.Equal(op.ReduceMax(attn_mask, axes, keepdims=1), const(float("-inf"), attn_mask))


@translation(aten.scaled_dot_product_attention.default, overrides_torchlib=True)
def aten_scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                      is_causal: bool = False, scale: float | None = None,
                                      enable_gqa: bool = False):
    """scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor

    Two faults of torchlib's translation, which this one wraps (its 4-D graph is kept, so ONNX
    Runtime's attention fusions still match it):
    - a query row whose mask hides every key (a fully padded sequence, a padding mask at length
      1): PyTorch (2.5+, ``_safe_softmax``) returns 0 for it; torchlib returns the mean of the
      values for a boolean mask (it masks with the type's lowest value, not -inf) and NaN for an
      additive -inf mask. Here the output rows whose mask row is all False / all -inf are 0.
      (Decided from the mask alone: a NaN query in such a row gives 0 where PyTorch's math path
      gives NaN.)
    - query/key/value of rank 3 or 5+ (no heads, or extra batch dims: timm's NesT/Hiera/SAM,
      nn.MultiheadAttention's 3-D call): torchlib asserts "only 4D". Here the leading dims are
      folded into one batch dim with a single head, and unfolded after (the mask expanded to
      the full [..., L, S] first).
    """
    torchlib = _torchlib_sdpa()
    fully = _fully_masked_rows(attn_mask, is_causal)
    r = len(query.shape)
    if r == 4:
        out = torchlib(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    else:
        if enable_gqa:
            raise ValueError(f"scaled_dot_product_attention: enable_gqa with {r}-D query is not "
                             "supported (only 4-D [batch, heads, length, dim])")
        length = op.Shape(query, start=-2, end=-1)
        source = op.Shape(key, start=-2, end=-1)
        lead = op.Shape(query, start=0, end=-2)

        def fold(x):
            folded = op.Reshape(x, op.Concat(ints([-1, 1]), op.Shape(x, start=-2), axis=0))
            # torchlib reads rank, element type and head size from the value's metadata
            folded.dtype = x.dtype
            folded.shape = ir.Shape([None, 1, None, x.shape[-1] if x.shape else None])
            return folded

        mask4 = None
        if attn_mask is not None:
            full = op.Concat(lead, length, source, axis=0)
            expanded = op.Expand(attn_mask, full)
            expanded.dtype = attn_mask.dtype
            mask4 = fold(expanded)
        out = torchlib(fold(query), fold(key), fold(value), mask4, dropout_p, is_causal, scale,
                       False)
        out = op.Reshape(out, op.Concat(lead, length, op.Shape(value, start=-1), axis=0))
    if fully is not None:
        out = op.Where(fully, const(0.0, out), out)
    return out


# ----------------------------------------------------- grid_sample: non-finite and far coordinates

_GRID_MODES = ("bilinear", "nearest", "bicubic")
_GRID_PADDING = ("zeros", "border", "reflection")


def _grid_sampler(input, grid, interpolation_mode: int, padding_mode: int, align_corners: bool):
    mode, padding = _GRID_MODES[interpolation_mode], _GRID_PADDING[padding_mode]
    fill = None
    if padding == "zeros":
        fill = 0.0 if mode == "nearest" else float("nan")
    elif mode == "bicubic":
        fill = float("nan")
    elif padding == "border":
        # PyTorch clamps the (pixel) coordinate before interpolating, so clamping the grid to
        # [-1, 1] first is the same for finite values, and sends +-inf and 1e10 to the border
        # (ONNX Runtime turns them into garbage indices); NaN stays NaN
        grid = op.Where(op.IsNaN(grid), grid,
                        op.Clip(grid, const(-1.0, grid), const(1.0, grid)))
    out = op.GridSample(input, grid, align_corners=align_corners,
                        mode={"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode),
                        padding_mode=padding)
    if fill is None:
        return out
    # [N, *out, 2] -> [N, 1, *out]: a sampling point with a NaN or infinite coordinate
    bad_coord = op.Or(op.IsNaN(grid), op.IsInf(grid))
    bad = op.ReduceMax(op.Cast(bad_coord, to=ir.DataType.INT32), ints([-1]), keepdims=0)
    bad = op.Unsqueeze(op.Cast(bad, to=ir.DataType.BOOL), ints([1]))
    return op.Where(bad, const(fill, out), out)


@translation(aten.grid_sampler.default, overrides_torchlib=True)
def aten_grid_sampler(input, grid, interpolation_mode: int, padding_mode: int,
                      align_corners: bool):
    """grid_sampler(Tensor input, Tensor grid, int interpolation_mode, int padding_mode, bool align_corners) -> Tensor

    torchlib maps it straight to GridSample, which agrees with PyTorch for finite coordinates
    near the image but not for a sampling point with a NaN or infinite coordinate (a perspective
    warp dividing by ~0, kornia's warp_perspective on a random homography) nor, with border
    padding, for coordinates far outside (1e10). PyTorch: zeros padding gives NaN there
    (bilinear, bicubic) or 0 (nearest); bicubic gives NaN with every padding; border clamps
    +-inf/far coordinates to the border. ONNX Runtime returns values from arbitrary pixels.
    Here those points are filled as PyTorch fills them and border grids are clamped to [-1, 1]
    first (the same result for finite coordinates: PyTorch clamps the coordinate before
    interpolating). Left as ONNX Runtime computes it: reflection padding at coordinates beyond
    about 1e7 (both sides lose every digit of the reflected position there)."""
    return _grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners)


@translation(aten.grid_sampler_2d.default, overrides_torchlib=True)
def aten_grid_sampler_2d(input, grid, interpolation_mode: int, padding_mode: int,
                         align_corners: bool):
    """grid_sampler_2d(Tensor input, Tensor grid, int interpolation_mode, int padding_mode, bool align_corners) -> Tensor

    The same as :func:`aten_grid_sampler` (the 2-D overload)."""
    return _grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners)


# -- FFTs: ONNX Runtime's float32 DFT at lengths that are not powers of two --------------------

def _torchlib_fft(name: str):
    """torchlib's FFT translation (a trace-only function, callable while tracing ours)."""
    from onnxscript.function_libs.torch_lib.ops import fft as torchlib_fft

    return getattr(torchlib_fft, name)


def _dft_in_double(x, lengths) -> bool:
    """Whether a float32 DFT over ``lengths`` must run in float64. ONNX Runtime's float32 DFT
    is radix-2 only for powers of two (error ~5x PyTorch's pocketfft there); at other lengths
    its error grows with n: normwise 4e-5 at 406, 1.1e-4 at 1000, 7.7e-4 at 10007, 300-3500x
    PyTorch's ~1.5e-7 (docs/miscompiles.md). Its float64 DFT is ~1e-13 there and costs
    5-45 % more than its float32 one. A dynamic length may be anything: float64."""
    if x.dtype != ir.DataType.FLOAT:
        return False
    return not all(isinstance(n, int) and n > 0 and n & (n - 1) == 0 for n in lengths)


def _fft_via_double(name: str, x, lengths, *args):
    fn = _torchlib_fft(name)
    if not _dft_in_double(x, lengths):
        return fn(x, *args)
    return op.Cast(fn(op.Cast(x, to=ir.DataType.DOUBLE), *args), to=ir.DataType.FLOAT)


@translation(aten._fft_r2c.default, overrides_torchlib=True)
def aten__fft_r2c(self, dim, normalization: int, onesided: bool):
    """_fft_r2c(Tensor self, int[] dim, int normalization, bool onesided) -> Tensor

    torchlib's DFT graph, run in float64 for float32 input unless every transformed length is
    a static power of two (see _dft_in_double)."""
    lengths = [self.shape[d] for d in dim]
    return _fft_via_double("aten__fft_r2c", self, lengths, dim, normalization, onesided)


@translation(aten._fft_c2r.default, overrides_torchlib=True, complex=True)
def aten__fft_c2r_complex(self, dim, normalization: int, last_dim_size):
    """_fft_c2r(Tensor self, int[] dim, int normalization, SymInt last_dim_size) -> Tensor

    As _fft_r2c; the last transformed length is ``last_dim_size`` (the real output's)."""
    lengths = [self.shape[d] for d in dim[:-1]] + [last_dim_size]
    return _fft_via_double("aten__fft_c2r", self, lengths, dim, normalization, last_dim_size)


@translation(aten._fft_c2c.default, overrides_torchlib=True, complex=True)
def aten__fft_c2c_complex(self, dim, normalization: int, forward: bool):
    """_fft_c2c(Tensor self, SymInt[] dim, int normalization, bool forward) -> Tensor

    As _fft_r2c."""
    lengths = [self.shape[d] for d in dim]
    return _fft_via_double("aten__fft_c2c", self, lengths, dim, normalization, forward)
