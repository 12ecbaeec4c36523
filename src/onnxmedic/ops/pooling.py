"""Pooling and resampling ops torchlib lacks or gets wrong: adaptive max pooling (1-3 d, with
indices), 3-d adaptive average pooling, fractional max pooling, average pooling with
``divisor_override``, anti-aliased bilinear/bicubic upsampling, grid_sampler_3d and CTC loss
(int or tensor lengths, every reduction; static T and target sizes).

Not translated because torchlib already gets them right (tests/ops/test_pooling.py pins that):
lp_pool1d/2d/3d (decomposed to avg_pool and pow, all norm types), max_unpool1d/2d/3d,
adaptive_avg_pool1d/2d with any sizes, F.grid_sample on 5-D input.

Every window op is built the same way: the window of each output position is a list of input
positions (a static index table where the spatial sizes are known at export, computed from the
random samples at run time for fractional pooling), gathered with ``Gather``/``GatherElements``
and reduced. Windows of different lengths are padded by repeating a valid position (max) or by a
static validity mask (sums), so inf and NaN only reach the outputs whose window holds them, as in
PyTorch. Window sums are separable and done one spatial axis at a time.

What plain torch.onnx 2.13 does with these (torchlib): adaptive_max_pool2d/3d and
_adaptive_avg_pool3d, fractional_max_pool2d/3d have no translation (export fails; adaptive max
pooling with sizes that divide the input is decomposed to max_pool and works), as has the
explicit grid_sampler_3d overload (F.grid_sample's grid_sampler works for 5-D input) and
_ctc_loss (torch.export already fails on it: no fake kernel; nor can it capture ctc_loss with
reduction='mean' or tensor lengths, see _register_ctc_decompositions);
avg_pool2d/3d with ``divisor_override`` and _upsample_bilinear2d_aa/_upsample_bicubic2d_aa with
``align_corners=True`` or explicit scales export and run but compute wrong numbers.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import opset18 as op

from onnxmedic.ops._common import FLOAT_DTYPES, add_fake_kernel, const, ints, static_shape
from onnxmedic.ops._registry import translation

logger = logging.getLogger(__name__)
aten = torch.ops.aten


# -- shared helpers -----------------------------------------------------------------------------

def _spatial(x, k: int, name: str) -> tuple[int, tuple[int, ...]]:
    """(number of leading batch/channel dims, static spatial sizes) of a pooling input."""
    rank = len(x.shape)
    if rank not in (k + 1, k + 2):
        raise ValueError(f"{name}: expected a {k + 1}-D or {k + 2}-D input, got rank {rank}")
    sizes = []
    for d in list(x.shape)[rank - k:]:
        if not isinstance(d, int):
            raise ValueError(f"{name}: the spatial sizes must be known at export time "
                             f"(got {list(x.shape)}); export with static spatial dims")
        sizes.append(d)
    return rank - k, tuple(sizes)


def _expand_param(value, k: int, default=None) -> list[int]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        value = default
    if isinstance(value, int):
        return [value] * k
    value = [int(v) for v in value]
    return value * k if len(value) == 1 else value


def _lead_shape(x, lead: int):
    return op.Shape(x, start=0, end=lead)


def _flatten_spatial(x, lead: int, numel: int):
    """x reshaped to (lead..., numel) (numel = product of the spatial sizes)."""
    return op.Reshape(x, op.Concat(_lead_shape(x, lead), ints([numel]), axis=0))


def _int64(values) -> ir.Value:
    return op.Constant(value=ir.tensor(np.asarray(values, dtype=np.int64)))


def _window_sum_axis(x, rank: int, axis: int, idx: np.ndarray, valid: np.ndarray | None,
                     weights: np.ndarray | None = None):
    """Sum (optionally weighted) over windows along ``axis``: ``idx``/``valid``/``weights`` are
    (O, K) tables; the result has O in place of the axis's size. Invalid entries add nothing
    (masked, so an inf or NaN elsewhere never leaks in through a zero weight). ``rank``: x's
    rank (traced intermediate values carry no shape)."""
    g = op.Gather(x, _int64(idx), axis=axis)  # (..., O, K, ...)
    tail = rank - axis - 1
    shape = list(idx.shape) + [1] * tail
    if weights is not None:
        w = op.CastLike(op.Constant(value=ir.tensor(weights.reshape(shape).astype(np.float64))),
                        x)
        g = op.Mul(g, w)
    if valid is not None and not valid.all():
        mask = op.Constant(value=ir.tensor(valid.reshape(shape)))
        g = op.Where(mask, g, const(0, x))
    return op.ReduceSum(g, ints([axis + 1]), keepdims=0)


def _select_max(vals, flat_idx, dtype):
    """Max over the last axis of ``vals`` with PyTorch's CPU rule ``val > max || isnan(val)``:
    the first maximum, or the last NaN when there is one. Returns (values, indices) where the
    indices are taken from ``flat_idx`` (same shape as vals, int64). ``dtype``: vals' element
    type (traced intermediate values carry none)."""
    if dtype in FLOAT_DTYPES:
        key = vals
        if dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            key = op.Cast(vals, to=ir.DataType.FLOAT)
        nan = op.IsNaN(key)
        key = op.Where(nan, op.CastLike(op.Constant(value_float=math.inf), key), key)
        first_max = op.ArgMax(key, axis=-1, keepdims=1, select_last_index=0)
        nan_f = op.Cast(nan, to=ir.DataType.FLOAT)
        last_nan = op.ArgMax(nan_f, axis=-1, keepdims=1, select_last_index=1)
        any_nan = op.Cast(op.ReduceMax(nan_f, ints([-1]), keepdims=1), to=ir.DataType.BOOL)
        pos = op.Where(any_nan, last_nan, first_max)
    else:
        key = vals if dtype in (ir.DataType.INT64, ir.DataType.INT32) \
            else op.Cast(vals, to=ir.DataType.INT64)
        pos = op.ArgMax(key, axis=-1, keepdims=1, select_last_index=0)
    values = op.Squeeze(op.GatherElements(vals, pos, axis=-1), ints([-1]))
    indices = op.Squeeze(op.GatherElements(flat_idx, pos, axis=-1), ints([-1]))
    return values, indices


def _combine_flat(tables: list[np.ndarray], sizes: tuple[int, ...]) -> np.ndarray:
    """Per-dim (O_d, K_d) position tables -> (O_1..O_k, K_1*..*K_k) flat plane positions,
    window positions in scan order (first spatial dim slowest), as PyTorch's loops."""
    k = len(tables)
    strides = [int(np.prod(sizes[d + 1:])) for d in range(k)]
    out = np.zeros([t.shape[0] for t in tables] + [t.shape[1] for t in tables], dtype=np.int64)
    for d, t in enumerate(tables):
        shape = [1] * (2 * k)
        shape[d], shape[k + d] = t.shape
        out = out + (t * strides[d]).reshape(shape)
    n_out = [t.shape[0] for t in tables]
    return out.reshape(n_out + [-1])


# -- adaptive pooling ---------------------------------------------------------------------------

def _adaptive_windows(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's adaptive windows [floor(o*I/O), ceil((o+1)*I/O)) as an (O, K) table padded by
    repeating each window's last position, and the (O, K) validity mask."""
    starts = [(o * size) // out for o in range(out)]
    ends = [-((-(o + 1) * size) // out) for o in range(out)]
    k = max((e - s for s, e in zip(starts, ends)), default=1)
    idx = np.zeros((out, k), dtype=np.int64)
    valid = np.zeros((out, k), dtype=bool)
    for o, (s, e) in enumerate(zip(starts, ends)):
        for j in range(k):
            idx[o, j] = min(s + j, e - 1)
            valid[o, j] = s + j < e
    return idx, valid


def _adaptive_max(x, output_size, k: int, name: str):
    lead, sizes = _spatial(x, k, name)
    outs = _expand_param(output_size, k)
    if len(outs) != k or any(o <= 0 for o in outs) or any(s <= 0 for s in sizes):
        raise ValueError(f"{name}: bad output_size {outs} for spatial sizes {sizes}")
    tables = [_adaptive_windows(s, o)[0] for s, o in zip(sizes, outs)]
    flat = _combine_flat(tables, sizes)  # (O..., K)
    numel = int(np.prod(sizes))
    xf = _flatten_spatial(x, lead, numel)
    vals = op.Gather(xf, _int64(flat), axis=lead)  # (lead..., O..., K)
    flat_idx = op.Expand(_int64(flat), op.Shape(vals))
    return _select_max(vals, flat_idx, x.dtype)


@translation(aten.adaptive_max_pool2d.default, static_shapes=True)
def aten_adaptive_max_pool2d(self, output_size):
    """adaptive_max_pool2d(Tensor self, int[2] output_size) -> (Tensor, Tensor)

    Also serves adaptive_max_pool1d (PyTorch routes it through the 2-d op). The spatial sizes
    must be static: each window's positions are a constant table (all windows gathered at once,
    padded to the longest by repeating a position). Ties: the first maximum; NaN: the last NaN
    of the window (PyTorch's ``val > max || isnan(val)``)."""
    return _adaptive_max(self, output_size, 2, "adaptive_max_pool2d")


@translation(aten.adaptive_max_pool3d.default, static_shapes=True)
def aten_adaptive_max_pool3d(self, output_size):
    """adaptive_max_pool3d(Tensor self, int[3] output_size) -> (Tensor, Tensor)

    As adaptive_max_pool2d; indices are flat positions in the D*H*W plane."""
    return _adaptive_max(self, output_size, 3, "adaptive_max_pool3d")


@translation(aten._adaptive_avg_pool3d.default, static_shapes=True)
def aten__adaptive_avg_pool3d(self, output_size):
    """_adaptive_avg_pool3d(Tensor self, SymInt[3] output_size) -> Tensor

    Window sums one spatial axis at a time (static window tables, masked, so inf/NaN stay in
    their windows), divided by the window volume."""
    lead, sizes = _spatial(self, 3, "adaptive_avg_pool3d")
    outs = _expand_param(output_size, 3)
    x = self
    count = np.ones(outs, dtype=np.float64)
    for d, (s, o) in enumerate(zip(sizes, outs)):
        idx, valid = _adaptive_windows(s, o)
        x = _window_sum_axis(x, lead + 3, lead + d, idx, valid)
        shape = [1, 1, 1]
        shape[d] = o
        count = count * valid.sum(axis=1).reshape(shape)
    return op.Div(x, op.CastLike(op.Constant(value=ir.tensor(count)), self))


# -- fractional max pooling ---------------------------------------------------------------------

def _fractional_max(x, kernel_size, output_size, samples, k: int, name: str):
    lead, sizes = _spatial(x, k, name)
    pools = _expand_param(kernel_size, k)
    outs = _expand_param(output_size, k)
    for s, p, o in zip(sizes, pools, outs):
        if o + p - 1 > s:
            raise ValueError(f"{name}: output_size {outs} + kernel_size {pools} - 1 is too "
                             f"large for input {sizes}")
    np_dtype = np.float64 if x.dtype == ir.DataType.DOUBLE else np.float32
    # samples: (N, C, k) -> x's leading shape + (k,) (an unbatched input uses samples[0])
    smp = op.Reshape(samples, op.Concat(_lead_shape(x, lead), ints([k]), axis=0))
    if x.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        smp = op.Cast(smp, to=ir.DataType.FLOAT)  # PyTorch computes the intervals in opmath
    # PyTorch uses sample[0] for the last spatial dim of 2-d pooling (W, then H) and sample
    # index d for dim d of 3-d pooling
    order = [1, 0] if k == 2 else [0, 1, 2]
    per_dim = []
    for d, (size, pool, out) in enumerate(zip(sizes, pools, outs)):
        s = op.Gather(smp, op.Constant(value=ir.tensor(order[d], dtype=ir.DataType.INT64)),
                      axis=-1)  # (lead...)
        s = op.Unsqueeze(s, ints([-1]))
        if out > 1:
            alpha = np.asarray(np_dtype(size - pool) / np_dtype(out - 1), dtype=np_dtype)
            a = op.CastLike(op.Constant(value=ir.tensor(alpha)), s)
            i = op.CastLike(op.Constant(value=ir.tensor(np.arange(out - 1, dtype=np_dtype))), s)
            seq = op.Sub(op.Cast(op.Mul(op.Add(i, s), a), to=ir.DataType.INT64),
                         op.Cast(op.Mul(s, a), to=ir.DataType.INT64))
            last = op.Expand(_int64([size - pool]), op.Shape(s))
            seq = op.Concat(seq, last, axis=-1)  # (lead..., O)
        else:
            seq = op.Expand(_int64([size - pool]), op.Shape(s))
        pos = op.Add(op.Unsqueeze(seq, ints([-1])), _int64(np.arange(pool)))  # (lead..., O, P)
        stride = int(np.prod(sizes[d + 1:]))
        per_dim.append(op.Mul(pos, _int64(stride)) if stride != 1 else pos)
    # flat positions (lead..., O_1..O_k, P_1..P_k): broadcast the per-dim tables
    flat = None
    for d, pos in enumerate(per_dim):
        # pos: (lead..., O_d, P_d) -> (lead..., 1.., O_d, 1.., 1.., P_d, 1..)
        pos = op.Unsqueeze(pos, ints([lead + j for j in range(k) if j != d]))  # O_d at lead+d
        pos = op.Unsqueeze(pos, ints([lead + k + j for j in range(k) if j != d]))  # P_d
        flat = pos if flat is None else op.Add(flat, pos)
    window = int(np.prod(pools))
    flat = op.Reshape(flat, op.Concat(_lead_shape(x, lead), ints(outs + [window]), axis=0))
    numel = int(np.prod(sizes))
    xf = _flatten_spatial(x, lead, numel)
    gathered = op.GatherElements(
        xf, op.Reshape(flat, op.Concat(_lead_shape(x, lead), ints([int(np.prod(outs)) * window]),
                                       axis=0)), axis=-1)  # no -1: the batch may be empty
    vals = op.Reshape(gathered, op.Shape(flat))
    return _select_max(vals, flat, x.dtype)


@translation(aten.fractional_max_pool2d.default, static_shapes=True)
def aten_fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    """fractional_max_pool2d(Tensor self, int[2] kernel_size, int[2] output_size, Tensor random_samples) -> (Tensor, Tensor)

    The intervals are computed from ``random_samples`` at run time exactly as PyTorch's
    generate_intervals (in the input's float type, truncated); the spatial sizes must be static.
    ``random_samples[..., 0]`` drives the width, ``[..., 1]`` the height (PyTorch's order)."""
    return _fractional_max(self, kernel_size, output_size, random_samples, 2,
                           "fractional_max_pool2d")


@translation(aten.fractional_max_pool3d.default, static_shapes=True)
def aten_fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    """fractional_max_pool3d(Tensor self, int[3] kernel_size, int[3] output_size, Tensor random_samples) -> (Tensor, Tensor)

    As fractional_max_pool2d; ``random_samples[..., d]`` drives spatial dim d."""
    return _fractional_max(self, kernel_size, output_size, random_samples, 3,
                           "fractional_max_pool3d")


# -- average pooling ----------------------------------------------------------------------------

def _pool_out_size(size: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """PyTorch's pooling_output_shape (dilation 1)."""
    num = size + 2 * p - (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = num // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _torchlib(name: str):
    """torchlib's own translation (a trace-only function, callable while tracing ours)."""
    from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

    return getattr(torchlib_nn, name)


def _has_static_spatial(x, k: int) -> bool:
    return all(isinstance(d, int) for d in list(x.shape)[len(x.shape) - k:])


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
              k: int, name: str):
    if divisor_override is None and not _has_static_spatial(x, k):
        # torchlib is right without divisor_override, and handles dynamic sizes
        return _torchlib(f"aten_{name}")(x, kernel_size, stride, padding, ceil_mode,
                                         count_include_pad, None)
    lead, sizes = _spatial(x, k, name)
    ks = _expand_param(kernel_size, k)
    ss = _expand_param(stride, k, default=ks)
    ps = _expand_param(padding, k, default=0)
    if divisor_override == 0:
        raise ValueError(f"{name}: divisor_override must be non-zero")
    out = x
    total_pool = None  # count_include_pad divisor: window size clipped to the padded input
    total_valid = None  # input elements in the window
    for d, (size, kk, s, p) in enumerate(zip(sizes, ks, ss, ps)):
        n_out = _pool_out_size(size, kk, s, p, bool(ceil_mode))
        idx = np.zeros((n_out, kk), dtype=np.int64)
        valid = np.zeros((n_out, kk), dtype=bool)
        pool = np.zeros(n_out)
        for o in range(n_out):
            start = o * s - p
            pool[o] = min(start + kk, size + p) - start
            for j in range(kk):
                valid[o, j] = 0 <= start + j < size  # padding adds zeros: inputs only
                idx[o, j] = min(max(start + j, 0), size - 1)
        out = _window_sum_axis(out, lead + k, lead + d, idx, valid)
        shape = [1] * k
        shape[d] = n_out
        nv = valid.sum(axis=1).astype(np.float64).reshape(shape)
        pl = pool.reshape(shape)
        total_valid = nv if total_valid is None else total_valid * nv
        total_pool = pl if total_pool is None else total_pool * pl
    if divisor_override is not None:
        return op.Div(out, const(int(divisor_override), x))
    divisor = total_pool if count_include_pad else total_valid
    # a window wholly in the padding sums nothing: PyTorch writes 0 there
    divisor = np.where(total_valid == 0, 1.0, divisor)
    return op.Div(out, op.CastLike(op.Constant(value=ir.tensor(divisor)), x))


@translation(aten.avg_pool2d.default, static_shapes=True, overrides_torchlib=True)
def aten_avg_pool2d(self, kernel_size, stride=(), padding=(0,), ceil_mode: bool = False,
                    count_include_pad: bool = True, divisor_override=None):
    """avg_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor

    Overrides torchlib, which ignores ``divisor_override`` (it divides by the window size), and
    whose AveragePool has no float64 kernel in ONNX Runtime. With static spatial sizes: window
    sums per spatial axis from static window tables, divided by PyTorch's divisor (the
    override, the window size clipped to the padded input with count_include_pad, else the
    number of input elements). With dynamic sizes and no divisor_override, torchlib's
    translation is used unchanged (it is right there); with divisor_override they must be
    static."""
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override, 2, "avg_pool2d")


@translation(aten.avg_pool3d.default, static_shapes=True, overrides_torchlib=True)
def aten_avg_pool3d(self, kernel_size, stride=(), padding=(0,), ceil_mode: bool = False,
                    count_include_pad: bool = True, divisor_override=None):
    """avg_pool3d(Tensor self, int[3] kernel_size, int[3] stride=[], int[3] padding=0, bool ceil_mode=False, bool count_include_pad=True, int? divisor_override=None) -> Tensor

    As avg_pool2d (torchlib ignores ``divisor_override`` here too)."""
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override, 3, "avg_pool3d")


# -- anti-aliased upsampling --------------------------------------------------------------------

def _bilinear_filter(x, ft):
    x = abs(x)
    return ft(1.0) - x if x < 1.0 else ft(0.0)


def _bicubic_filter(x, ft):
    a = ft(-0.5)  # PIL's (and PyTorch's antialias) Keys parameter
    x = abs(x)
    if x < 1.0:
        return ((a + ft(2)) * x - (a + ft(3))) * x * x + ft(1)
    if x < 2.0:
        return ((a * x - ft(5) * a) * x + ft(8) * a) * x - ft(4) * a
    return ft(0.0)


def _aa_scale(size: int, out: int, align_corners: bool, scale, ft):
    """PyTorch's area_pixel_compute_scale in its opmath type ``ft``."""
    if align_corners:
        return ft(size - 1) / ft(out - 1) if out > 1 else ft(0.0)
    if scale is not None and scale > 0:
        return ft(1.0 / scale)
    return ft(size) / ft(out)


def _aa_tables(size: int, out: int, align_corners: bool, scale, interp_size: int, filt, ft):
    """PyTorch's _compute_weights_aa: (O, K) positions, normalised weights, validity.

    Replays the kernel's arithmetic in its opmath type ``ft`` (float32 for float32 input, with
    the same float/double promotions as the C++), so window bounds that sit on a rounding
    boundary come out the same."""
    sc = _aa_scale(size, out, align_corners, scale, ft)
    support = ft(interp_size * 0.5 * float(sc)) if sc >= 1.0 else ft(interp_size * 0.5)
    invscale = ft(1.0 / float(sc)) if sc >= 1.0 else ft(1.0)
    rows = []
    for i in range(out):
        center = ft(float(sc) * (i + 0.5))
        xmin = max(int(float(center - support) + 0.5), 0)
        xsize = min(int(float(center + support) + 0.5), size) - xmin
        w = [filt(ft((float(ft(j + xmin) - center) + 0.5) * float(invscale)), ft)
             for j in range(xsize)]
        total = ft(0.0)
        for v in w:
            total = ft(total + v)
        if total != 0.0:
            w = [ft(v / total) for v in w]
        rows.append((xmin, w))
    k = max(max((len(w) for _, w in rows), default=1), 1)
    idx = np.zeros((out, k), dtype=np.int64)
    weights = np.zeros((out, k), dtype=np.float64)
    valid = np.zeros((out, k), dtype=bool)
    for o, (xmin, w) in enumerate(rows):
        for j in range(k):
            if j < len(w):
                idx[o, j], weights[o, j], valid[o, j] = xmin + j, float(w[j]), True
            else:
                idx[o, j] = min(xmin, size - 1)
    return idx, weights, valid


def _upsample_aa(x, output_size, align_corners: bool, scales, interp_size: int, filt,
                 name: str):
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: only floating-point inputs are translated (PyTorch's uint8 "
                         f"kernel rounds differently); got {x.dtype}")
    if not _has_static_spatial(x, 2):
        if align_corners or any(v is not None for v in scales):
            raise ValueError(f"{name}: with align_corners=True or explicit scales the spatial "
                             f"sizes must be static (torchlib's Resize gets these wrong)")
        return _torchlib(f"aten_{name}")(x, output_size, align_corners, *scales)
    lead, sizes = _spatial(x, 2, name)
    outs = _expand_param(output_size, 2)
    ft = np.float64 if x.dtype == ir.DataType.DOUBLE else np.float32
    out = x
    # PyTorch's separable kernel resamples the width first, then the height
    for d in (1, 0):
        idx, w, valid = _aa_tables(sizes[d], outs[d], bool(align_corners), scales[d],
                                   interp_size, filt, ft)
        out = _window_sum_axis(out, lead + 2, lead + d, idx, valid, w)
    return out


@translation(aten._upsample_bilinear2d_aa.default, static_shapes=True, overrides_torchlib=True)
def aten__upsample_bilinear2d_aa(self, output_size, align_corners: bool, scales_h=None,
                                 scales_w=None):
    """_upsample_bilinear2d_aa(Tensor self, SymInt[2] output_size, bool align_corners, float? scales_h=None, float? scales_w=None) -> Tensor

    Overrides torchlib (ONNX Resize with antialias), which is wrong with ``align_corners=True``
    and with explicit scales (PyTorch then sizes the filter from the scale, not from the
    sizes). Here PyTorch's own filter weights (support, normalisation) are computed at export
    for the static sizes and applied as gathered, weighted window sums, width then height.
    With dynamic spatial sizes, torchlib's translation is used where it is right
    (align_corners=False, no scales); otherwise the export fails with the reason."""
    return _upsample_aa(self, output_size, align_corners, (scales_h, scales_w), 2,
                        _bilinear_filter, "_upsample_bilinear2d_aa")


@translation(aten._upsample_bicubic2d_aa.default, static_shapes=True, overrides_torchlib=True)
def aten__upsample_bicubic2d_aa(self, output_size, align_corners: bool, scales_h=None,
                                scales_w=None):
    """_upsample_bicubic2d_aa(Tensor self, SymInt[2] output_size, bool align_corners, float? scales_h=None, float? scales_w=None) -> Tensor

    As _upsample_bilinear2d_aa with PyTorch's antialias cubic filter (a = -0.5)."""
    return _upsample_aa(self, output_size, align_corners, (scales_h, scales_w), 4,
                        _bicubic_filter, "_upsample_bicubic2d_aa")


# -- grid sampling ------------------------------------------------------------------------------

@translation(aten.grid_sampler_3d.default)
def aten_grid_sampler_3d(input, grid, interpolation_mode: int, padding_mode: int,
                         align_corners: bool):
    """grid_sampler_3d(Tensor input, Tensor grid, int interpolation_mode, int padding_mode, bool align_corners) -> Tensor

    torchlib translates ``grid_sampler`` (what F.grid_sample records) with ONNX GridSample for
    4-D and 5-D inputs, but not the explicit 3-d overload (``torch.grid_sampler_3d``). Same
    mapping here. Note: GridSample accepts 5-D input from opset 20 on; ONNX Runtime also runs it
    at the exporter's default opset, as it does for torchlib's grid_sampler."""
    modes = ("bilinear", "nearest")
    if interpolation_mode not in (0, 1):
        raise ValueError(f"grid_sampler_3d: interpolation_mode {interpolation_mode} is not "
                         f"supported for 5-D input (PyTorch: 0 bilinear, 1 nearest)")
    if padding_mode not in (0, 1, 2):
        raise ValueError(f"grid_sampler_3d: unknown padding_mode {padding_mode}")
    return op.GridSample(input, grid, align_corners=int(bool(align_corners)),
                         mode=modes[interpolation_mode],
                         padding_mode=("zeros", "border", "reflection")[padding_mode])


# -- CTC loss -----------------------------------------------------------------------------------

def _ctc_fake(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """Shapes of aten::_ctc_loss's outputs: (nll (B,), log_alpha (B, T, 2*max(S)+1))."""
    t, b = log_probs.shape[0], log_probs.shape[1]
    s = max(target_lengths, default=0)
    return log_probs.new_empty((b,)), log_probs.new_empty((b, t, 2 * s + 1))


# aten::_ctc_loss is tagged dynamic_output_shape and has no fake kernel; with int lengths its
# output shapes are static, so torch.export can trace it once this kernel is registered.
add_fake_kernel("aten::_ctc_loss", _ctc_fake)


def _ctc_nll_eager(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                   target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    return torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths,
                                           blank, zero_infinity)[0]


def _ctc_nll_fake(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return log_probs.new_empty((log_probs.shape[1],))


def _ctc_nll_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.blank, ctx.zero_infinity = inputs[4], inputs[5]


def _ctc_nll_backward(ctx, grad):
    """PyTorch's own ctc_loss backward (it needs log_alpha, recomputed here), so that the
    decomposition stays differentiable wherever it is traced (e.g. torch.compile)."""
    lp, tg, il, tl = ctx.saved_tensors
    nll, log_alpha = torch.ops.aten._ctc_loss.Tensor(lp, tg, il, tl, ctx.blank, ctx.zero_infinity)
    g = torch.ops.aten._ctc_loss_backward.Tensor(grad, lp, tg, il, tl, nll, log_alpha, ctx.blank,
                                                 ctx.zero_infinity)
    return g, None, None, None, None, None


def _ctc_composite(log_probs, targets, input_lengths, target_lengths, blank: int,
                   reduction: int, zero_infinity: bool, nll):
    """PyTorch's ctc_loss composite (LossCTC.cpp ctc_loss_impl, non-cuDNN branch), with the
    per-sequence losses from ``nll(log_probs, targets)``."""
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    res = nll(lp, targets.to(lp.device, torch.long))
    if zero_infinity:
        res = torch.where(res == math.inf, torch.zeros((), dtype=res.dtype), res)
    if reduction == 1:  # mean: each loss divided by its (at least 1) target length
        if isinstance(target_lengths, torch.Tensor):
            return (res / target_lengths.clamp_min(1)).mean()
        # PyTorch builds a tensor from the list, which fake tensors cannot (no constants here:
        # torch.onnx's re-trace cannot lift them); dividing each by a number is the same
        return torch.stack([res[i] / float(max(int(v), 1))
                            for i, v in enumerate(target_lengths)]).mean()
    if reduction == 2:
        return res.sum()
    return res if batched else res.squeeze(0)


def _ctc_loss_intlist(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1,
                      zero_infinity=False):
    return _ctc_composite(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                          zero_infinity, lambda lp, tg: aten._ctc_loss.default(
                              lp, tg, input_lengths, target_lengths, blank, zero_infinity)[0])


def _ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1,
                     zero_infinity=False):
    return _ctc_composite(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                          zero_infinity, lambda lp, tg: torch.ops.onnxmedic.ctc_nll.default(
                              lp, tg, input_lengths, target_lengths, blank, zero_infinity))


def _register_ctc_decompositions() -> None:
    """Make ctc_loss with reduction='mean' and with tensor lengths capturable by torch.export.

    torch.export keeps ctc_loss whole and runs PyTorch's C++ composite only to propagate
    shapes, which fails for 'mean' (it builds a tensor from the int lengths: not possible on
    fake tensors) and for tensor lengths (aten::_ctc_loss.Tensor's log_alpha has a data-
    dependent size that never reaches the output: PendingUnbackedSymbolNotFound). Python
    kernels for the CompositeImplicitAutograd key (consulted only under the Python dispatcher,
    i.e. while tracing; eager calls keep PyTorch's kernel) replay the same composite; with
    tensor lengths the per-sequence losses come from ``onnxmedic::ctc_nll``, a custom op that
    returns only the losses (eager: aten::_ctc_loss.Tensor), so no data-dependent size
    appears. Private torch API: if it moves, these cases stay uncapturable, as before."""
    try:
        lib = torch.library.Library("onnxmedic", "FRAGMENT")
        if not hasattr(torch.ops.onnxmedic, "ctc_nll"):
            lib.define("ctc_nll(Tensor log_probs, Tensor targets, Tensor input_lengths, "
                       "Tensor target_lengths, int blank, bool zero_infinity) -> Tensor")
            lib.impl("ctc_nll", _ctc_nll_eager, "CompositeExplicitAutograd")
            torch.library.register_fake("onnxmedic::ctc_nll", _ctc_nll_fake, lib=lib)
            torch.library.register_autograd("onnxmedic::ctc_nll", _ctc_nll_backward,
                                            setup_context=_ctc_nll_setup, lib=lib)
            _CTC_LIBS.append(lib)
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        for target, kernel in ((aten.ctc_loss.IntList, _ctc_loss_intlist),
                               (aten.ctc_loss.Tensor, _ctc_loss_tensor)):
            if key not in target.py_kernels:
                target.py_impl(key)(kernel)
    except Exception:  # pragma: no cover - depends on torch internals
        logger.debug("ctc_loss decompositions not registered", exc_info=True)


_CTC_LIBS: list[torch.library.Library] = []  # a Library's definitions live as long as it does
_register_ctc_decompositions()


def _ctc_extended(targets, tg_lens, n_b: int, width: int, blank: int):
    """Extended targets (B, W): blank at even positions, label (s-1)//2 at odd ones. With
    static ``tg_lens`` (a list) positions past 2*len hold blanks; with dynamic ones (a tensor)
    they hold some label, which no result reads (alpha only flows to higher positions)."""
    t_shape = static_shape(targets)
    odd = np.zeros((n_b, width), dtype=bool)
    odd[:, 1::2] = True
    pos = np.zeros((n_b, width), dtype=np.int64)
    blank_c = op.Constant(value=ir.tensor(np.array(blank, dtype=np.int64)))
    if not odd.any():
        return op.Expand(blank_c, ints([n_b, width]))
    flat = op.Reshape(op.Cast(targets, to=ir.DataType.INT64), ints([-1]))
    label = np.arange(width) // 2
    if isinstance(tg_lens, list):
        if len(t_shape) == 2:
            offsets = [b * t_shape[1] for b in range(n_b)]
        else:
            offsets = [int(v) for v in np.concatenate([[0], np.cumsum(tg_lens)[:-1]])]
        for b in range(n_b):
            odd[b, 2 * tg_lens[b] + 1:] = False
            pos[b] = np.where(odd[b], offsets[b] + label, 0)
        idx = _int64(pos)
    elif len(t_shape) == 2:
        idx = _int64(np.arange(n_b)[:, None] * t_shape[1] + np.minimum(label, t_shape[1] - 1))
    else:  # concatenated: offset of sequence b is the sum of the lengths before it
        offsets = op.CumSum(tg_lens, op.Constant(value=ir.tensor(np.array(0, dtype=np.int64))),
                            exclusive=1)
        idx = op.Add(op.Unsqueeze(offsets, ints([1])), _int64(label[None, :]))
        idx = op.Min(idx, ints([max(t_shape[0] - 1, 0)]))
    return op.Where(op.Constant(value=ir.tensor(odd)), op.Gather(flat, idx, axis=0), blank_c)


def _ctc_forward(log_probs, ext, n_t: int, n_b: int, width: int, active_at, tg_lens):
    """PyTorch's forward recursion (ctc_loss_cpu_template) over the extended targets: the
    per-sequence negative log likelihood (B,) and alpha at every step [(B, W)] * T.
    ``active_at(t)`` is None (every sequence still runs at step t), False (none does) or a
    (B, 1) bool value; ``tg_lens`` a list (static) or a (B,) int64 value."""
    neg = const(-math.inf, log_probs)
    zero = const(0.0, log_probs)
    # emissions E[t, b, s] = log_probs[t, b, ext[b, s]]
    emit = op.GatherElements(log_probs, op.Expand(op.Unsqueeze(ext, ints([0])),
                                                  ints([n_t, n_b, width])), axis=2)
    # constants shared by all the unrolled steps (fewer nodes: faster to export)
    c0, c1, c2 = ints([0]), ints([1]), ints([2])
    c_w1, c_w2 = ints([width - 1]), ints([width - 2])

    def at_t(t):
        return op.Gather(emit, op.Constant(value=ir.tensor(np.array(t, dtype=np.int64))),
                         axis=0)

    # alpha_0: positions 0 and 1 (1 only for a non-empty target where the lengths are static;
    # with dynamic lengths position 1 of an empty target is computed but never read)
    init = np.zeros((n_b, width), dtype=bool)
    init[:, : min(width, 2)] = True
    if isinstance(tg_lens, list) and width > 1:
        init[:, 1] = [v > 0 for v in tg_lens]
    alpha = op.Where(op.Constant(value=ir.tensor(init)), at_t(0), neg)
    if width >= 3:
        ne = op.Not(op.Equal(op.Slice(ext, c2, ints([width]), c1), op.Slice(ext, c0, c_w2, c1)))
        skip = op.Concat(op.Constant(value=ir.tensor(np.zeros((n_b, 2), dtype=bool))), ne,
                         axis=1)
        neg_skip = op.Where(skip, zero, neg)  # 0 where a skip is allowed, -inf elsewhere
    pad1 = op.Expand(neg, ints([n_b, 1]))
    pad2 = op.Expand(neg, ints([n_b, 2]))
    alphas = [alpha]
    for t in range(1, n_t):
        active = active_at(t)
        if active is False:
            alphas.append(alpha)
            continue
        terms = [alpha, op.Concat(pad1, op.Slice(alpha, c0, c_w1, c1), axis=1)]
        if width >= 3:
            a3 = op.Concat(pad2, op.Slice(alpha, c0, c_w2, c1), axis=1)
            terms.append(op.Add(a3, neg_skip))
        m = op.Max(*terms)
        m = op.Where(op.Equal(m, neg), zero, m)
        acc = None
        for a in terms:
            e = op.Exp(op.Sub(a, m))
            acc = e if acc is None else op.Add(acc, e)
        new = op.Add(op.Add(op.Log(acc), m), at_t(t))
        alpha = new if active is None else op.Where(active, new, alpha)
        alphas.append(alpha)
    if isinstance(tg_lens, list):
        last = _int64(np.array([[2 * v] for v in tg_lens], dtype=np.int64))
        prev = _int64(np.array([[max(2 * v - 1, 0)] for v in tg_lens], dtype=np.int64))
        has_prev = np.array([[v > 0] for v in tg_lens])
        has_prev = None if has_prev.all() else op.Constant(value=ir.tensor(has_prev))
    else:
        tl = op.Unsqueeze(tg_lens, ints([1]))
        last = op.Mul(tl, ints([2]))
        prev = op.Max(op.Sub(last, ints([1])), ints([0]))
        has_prev = op.Greater(tl, ints([0]))
    l1 = op.GatherElements(alpha, last, axis=1)
    l2 = op.GatherElements(alpha, prev, axis=1)
    if has_prev is not None:
        l2 = op.Where(has_prev, l2, neg)
    m = op.Max(l1, l2)
    m = op.Where(op.Equal(m, neg), zero, m)
    ll = op.Add(op.Log(op.Add(op.Exp(op.Sub(l1, m)), op.Exp(op.Sub(l2, m)))), m)
    return op.Neg(op.Squeeze(ll, ints([1]))), alphas


def _ctc_sizes(log_probs, targets, name: str) -> tuple[int, int]:
    shape = static_shape(log_probs)
    if shape is None or len(shape) != 3:
        raise ValueError(f"{name}: log_probs must be (T, B, C) with static sizes")
    if static_shape(targets) is None:
        raise ValueError(f"{name}: targets must have static sizes")
    return shape[0], shape[1]


@translation(aten._ctc_loss.default, static_shapes=True)
def aten__ctc_loss(log_probs, targets, input_lengths, target_lengths, blank: int = 0,
                   zero_infinity: bool = False):
    """_ctc_loss(Tensor log_probs, Tensor targets, int[] input_lengths, int[] target_lengths, int blank=0, bool zero_infinity=False) -> (Tensor, Tensor)

    PyTorch's forward recursion (ctc_loss_cpu_template) over the extended target
    (blank, l1, blank, l2, ..., blank), vectorised over batch and target positions and unrolled
    over time: T and the lengths are static (known at export). Targets may be padded
    (B, S) or concatenated 1-D. The loss is exact up to rounding; ``log_alpha`` (only used by
    PyTorch's backward, and partly uninitialised there) holds our recursion, frozen after each
    sequence's input length. ``zero_infinity`` and the reductions are applied by the ctc_loss
    composite around this op, as in PyTorch (for 'mean' the Python replay registered above)."""
    n_t, n_b = _ctc_sizes(log_probs, targets, "_ctc_loss")
    in_lens, tg_lens = [int(v) for v in input_lengths], [int(v) for v in target_lengths]
    if len(in_lens) != n_b or len(tg_lens) != n_b:
        raise ValueError(f"_ctc_loss: expected {n_b} input and target lengths")
    if any(not 1 <= v <= n_t for v in in_lens):
        raise ValueError(f"_ctc_loss: input_lengths must be in [1, {n_t}] (got {in_lens})")
    width = 2 * max(tg_lens, default=0) + 1
    ext = _ctc_extended(targets, tg_lens, n_b, width, blank)

    def active_at(t):
        active = np.array([[t < v] for v in in_lens])
        if active.all():
            return None
        return op.Constant(value=ir.tensor(active)) if active.any() else False

    nll, alphas = _ctc_forward(log_probs, ext, n_t, n_b, width, active_at, tg_lens)
    log_alpha = op.Concat(*[op.Unsqueeze(a, ints([1])) for a in alphas], axis=1)
    return nll, log_alpha


@translation(torch.ops.onnxmedic.ctc_nll.default, static_shapes=True)
def onnxmedic_ctc_nll(log_probs, targets, input_lengths, target_lengths, blank: int,
                      zero_infinity: bool):
    """onnxmedic::ctc_nll(Tensor log_probs, Tensor targets, Tensor input_lengths, Tensor target_lengths, int blank, bool zero_infinity) -> Tensor

    ctc_loss with tensor lengths: the same recursion as ``_ctc_loss`` with the lengths read at
    run time. T and the targets' size must be static; the extended target is as wide as the
    targets allow (2S+1 for padded (B, S) targets, 2N+1 for N concatenated labels). Lengths out
    of PyTorch's range (which PyTorch rejects) are not checked."""
    n_t, n_b = _ctc_sizes(log_probs, targets, "ctc_loss")
    t_shape = static_shape(targets)
    width = 2 * (t_shape[1] if len(t_shape) == 2 else t_shape[0]) + 1
    in_lens = op.Reshape(op.Cast(input_lengths, to=ir.DataType.INT64), ints([-1]))
    tg_lens = op.Reshape(op.Cast(target_lengths, to=ir.DataType.INT64), ints([-1]))
    ext = _ctc_extended(targets, tg_lens, n_b, width, blank)
    in_col = op.Unsqueeze(in_lens, ints([1]))
    steps = [op.Constant(value=ir.tensor(np.array(t, dtype=np.int64))) for t in range(n_t)]
    nll, _ = _ctc_forward(log_probs, ext, n_t, n_b, width,
                          lambda t: op.Less(steps[t], in_col), tg_lens)
    return nll
