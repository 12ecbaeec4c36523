"""torchvision on a CPU-only torch: its C++ ops defined with ``torch.library``, kernels in torch.

The torchvision wheels built for torch 2.13 are CUDA builds; next to the CPU torch their ``_C``
extension does not load, and ``import torchvision`` then fails with "operator torchvision::nms
does not exist" (its Python side registers fake kernels for ops that were never defined).
:func:`install` defines every op of the ``torchvision`` namespace with the schema of the
torchvision release (0.28, the one built for torch 2.13), gives each a CPU reference kernel
written in torch and a fake (shape) kernel, imports torchvision, and marks its ops as loaded so
that ``torchvision.ops.nms`` & co. call them (and torch.export records them as
``torchvision::nms`` nodes, which onnxmedic translates).

This is a test and bench helper, never part of the package: call :func:`install` before anything
imports torchvision (transformers imports it when it is installed). Where torchvision's own
extension loads (a CUDA machine with a matching torch), :func:`install` leaves the real ops alone;
the reference kernels stay callable as plain functions (``REFERENCE``) for comparing with them.

The kernels follow torchvision's CPU kernels (``torchvision/csrc/ops/cpu``): the same rounding,
sampling grids and out-of-image rules; they are written for clarity (a loop over the RoIs), not
speed.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

TORCHVISION_VERSION = "0.28.0"  # the release built for torch 2.13; its schemas are below

# torchvision 0.28's op schemas (torchvision/csrc/ops/*.cpp, TORCH_LIBRARY_FRAGMENT)
SCHEMAS: dict[str, str] = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                 "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, "
                           "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, "
                           "SymInt channels, SymInt height, SymInt width, int sampling_ratio, "
                           "bool aligned) -> Tensor",
    "qroi_align": "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, "
                  "float rois_scale, int rois_zero_point, float spatial_scale, "
                  "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
                  "bool aligned) -> Tensor",
    "ps_roi_align": "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, "
                    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio) "
                    "-> (Tensor, Tensor)",
    "_ps_roi_align_backward": "_ps_roi_align_backward(Tensor grad, Tensor rois, "
                              "Tensor channel_mapping, float spatial_scale, SymInt pooled_height, "
                              "SymInt pooled_width, int sampling_ratio, SymInt batch_size, "
                              "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool": "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward": "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, "
                          "float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
                          "SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
                          "-> Tensor",
    "ps_roi_pool": "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, "
                   "SymInt pooled_height, SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "_ps_roi_pool_backward(Tensor grad, Tensor rois, "
                             "Tensor channel_mapping, float spatial_scale, SymInt pooled_height, "
                             "SymInt pooled_width, SymInt batch_size, SymInt channels, "
                             "SymInt height, SymInt width) -> Tensor",
    "deform_conv2d": "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, "
                     "Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
                     "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, "
                     "bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, "
                               "Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
                               "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
                               "SymInt dilation_w, SymInt groups, SymInt offset_groups, "
                               "bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "box_iou_rotated": "box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor",
    "_cuda_version": "_cuda_version() -> int",
}

_LIB: torch.library.Library | None = None
_STATE: dict[str, Any] = {"installed": False, "real_ops": False}


# ---------------------------------------------------------------------------------------------
# reference kernels
# ---------------------------------------------------------------------------------------------

def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of (x1, y1, x2, y2) boxes, [N, 4] x [M, 4] -> [N, M], as torchvision's nms computes it
    (areas without +1; a pair with no union gives NaN, which suppresses nothing)."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area_a[:, None] + area_b[None, :] - inter)


def nms_ref(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """torchvision::nms: greedy suppression in order of decreasing score (a stable sort, so the
    lower index wins a tie); a box is dropped when its IoU with a kept one is > the threshold."""
    if dets.numel() == 0:
        return torch.empty((0,), dtype=torch.long, device=dets.device)
    order = torch.sort(scores, stable=True, descending=True).indices
    iou = box_iou(dets[order], dets[order])
    suppressed = torch.zeros(order.numel(), dtype=torch.bool)
    keep = []
    for i in range(order.numel()):
        if bool(suppressed[i]):
            continue
        keep.append(i)
        suppressed |= iou[i] > iou_threshold
    return order[torch.tensor(keep, dtype=torch.long)]


def _axis_weights(pos: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear weights [P, size] of sample positions ``pos`` [P] along one axis, with
    torchvision's roi_align rules: a sample below -1 or above ``size`` is 0; one in [-1, 0) reads
    the first row; one at or past the last row reads the last."""
    w = torch.zeros(pos.numel(), size, dtype=pos.dtype)
    valid = (pos >= -1.0) & (pos <= size)
    p = pos.clamp(min=0)
    low = p.floor().long()
    last = low >= size - 1
    low = torch.where(last, size - 1, low)
    high = torch.where(last, size - 1, low + 1)
    p = torch.where(last, low.to(p.dtype), p)
    frac = p - low.to(p.dtype)
    rows = torch.arange(pos.numel())
    w.index_put_((rows, low), torch.where(valid, 1.0 - frac, 0.0), accumulate=True)
    w.index_put_((rows, high), torch.where(valid, frac, 0.0), accumulate=True)
    return w


def _bin_positions(start: torch.Tensor, bin_size: torch.Tensor, bins: int, grid: int
                   ) -> torch.Tensor:
    """Sample positions [bins * grid] of ``grid`` points per bin, at the points' centres."""
    b = torch.arange(bins, dtype=start.dtype)[:, None]
    g = torch.arange(grid, dtype=start.dtype)[None, :]
    return (start + b * bin_size + (g + 0.5) * bin_size / grid).reshape(-1)


def _read_span(weights: torch.Tensor) -> slice:
    """The columns of ``weights`` [P, size] between its first and last non-zero one."""
    used = weights.ne(0).any(0).nonzero()
    return slice(int(used[0]), int(used[-1]) + 1) if used.numel() else slice(0, 1)


def _align_one(image: torch.Tensor, box: torch.Tensor, ph: int, pw: int, sampling_ratio: int,
               clamp_size: bool) -> torch.Tensor:
    """Average-pooled bilinear samples of one RoI (already scaled and shifted): [C, ph, pw]."""
    x1, y1, x2, y2 = box.unbind()
    rw, rh = x2 - x1, y2 - y1
    if clamp_size:
        rw, rh = rw.clamp(min=1.0), rh.clamp(min=1.0)
    bh, bw = rh / ph, rw / pw
    gh = sampling_ratio if sampling_ratio > 0 else max(math.ceil(float(rh) / ph), 0)
    gw = sampling_ratio if sampling_ratio > 0 else max(math.ceil(float(rw) / pw), 0)
    c, h, w = image.shape
    if gh == 0 or gw == 0:
        return image.new_zeros(c, ph, pw)
    wy = _axis_weights(_bin_positions(y1, bh, ph, gh), h)  # [ph*gh, H]
    wx = _axis_weights(_bin_positions(x1, bw, pw, gw), w)  # [pw*gw, W]
    # only the rows and columns the samples read (a small RoI on a large level reads few)
    ys, xs = _read_span(wy), _read_span(wx)
    # the bin's average is linear in the samples: each bin's grid of weights summed first, so
    # the product is [ph, H] @ [C, H, W] @ [W, pw] instead of a reduction of every sample (a
    # strided sum that made this kernel most of an R-CNN's PyTorch run)
    bin_y = wy[:, ys].reshape(ph, gh, -1).sum(1)
    bin_x = wx[:, xs].reshape(pw, gw, -1).sum(1)
    return bin_y @ image[:, ys, xs] @ bin_x.t() / (gh * gw)


def roi_align_ref(input: torch.Tensor, rois: torch.Tensor, spatial_scale: float,
                  pooled_height: int, pooled_width: int, sampling_ratio: int,
                  aligned: bool) -> torch.Tensor:
    """torchvision::roi_align: rois [K, 5] (batch index, x1, y1, x2, y2) -> [K, C, ph, pw]."""
    k = rois.shape[0]
    out = input.new_zeros(k, input.shape[1], pooled_height, pooled_width)
    offset = 0.5 if aligned else 0.0
    for i in range(k):
        box = rois[i, 1:] * spatial_scale - offset
        out[i] = _align_one(input[int(rois[i, 0])], box, pooled_height, pooled_width,
                            sampling_ratio, clamp_size=not aligned)
    return out


def _cpp_round(x: torch.Tensor) -> int:
    """C++ ``round`` (half away from zero), which torchvision's roi_pool uses."""
    v = float(x)
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def _pool_one(image: torch.Tensor, box: torch.Tensor, ph: int, pw: int, scale: float,
              plus_one: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Max over each bin of one RoI, with the flat argmax (-1 for an empty bin)."""
    c, h, w = image.shape
    sw, sh, ew, eh = (_cpp_round(v * scale) for v in box.unbind())
    rw, rh = max(ew - sw + plus_one, 1), max(eh - sh + plus_one, 1)
    bin_h, bin_w = torch.tensor(rh / ph, dtype=torch.float32), torch.tensor(rw / pw,
                                                                             dtype=torch.float32)
    out = image.new_zeros(c, ph, pw)
    arg = torch.full((c, ph, pw), -1, dtype=torch.int32)
    for i in range(ph):
        hs = min(max(int(torch.floor(i * bin_h)) + sh, 0), h)
        he = min(max(int(torch.ceil((i + 1) * bin_h)) + sh, 0), h)
        for j in range(pw):
            ws = min(max(int(torch.floor(j * bin_w)) + sw, 0), w)
            we = min(max(int(torch.ceil((j + 1) * bin_w)) + sw, 0), w)
            if he <= hs or we <= ws:
                continue
            region = image[:, hs:he, ws:we].reshape(c, -1)
            val, idx = region.max(dim=1)  # first maximum, as the kernel's strict '>'
            out[:, i, j] = val
            arg[:, i, j] = ((idx // (we - ws) + hs) * w + idx % (we - ws) + ws).to(torch.int32)
    return out, arg


def roi_pool_ref(input: torch.Tensor, rois: torch.Tensor, spatial_scale: float,
                 pooled_height: int, pooled_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision::roi_pool: max over integer bins (Fast R-CNN); returns (output, argmax)."""
    k, c = rois.shape[0], input.shape[1]
    out = input.new_zeros(k, c, pooled_height, pooled_width)
    arg = torch.full((k, c, pooled_height, pooled_width), -1, dtype=torch.int32)
    for i in range(k):
        out[i], arg[i] = _pool_one(input[int(rois[i, 0])], rois[i, 1:], pooled_height,
                                   pooled_width, spatial_scale, plus_one=1)
    return out, arg


def _ps_channels(c_out: int, ph: int, pw: int) -> torch.Tensor:
    """The input channel each (c, i, j) output cell reads: (c * ph + i) * pw + j."""
    return torch.arange(c_out * ph * pw, dtype=torch.int32).reshape(c_out, ph, pw)


def ps_roi_align_ref(input: torch.Tensor, rois: torch.Tensor, spatial_scale: float,
                     pooled_height: int, pooled_width: int, sampling_ratio: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision::ps_roi_align: position-sensitive roi_align (the -0.5 shift always on, no
    minimum RoI size; an adaptive grid of a reversed RoI divides by a count of 0, NaN, as the
    kernel does); bin (i, j) of output channel c reads input channel (c*ph + i)*pw + j."""
    k, ph, pw = rois.shape[0], pooled_height, pooled_width
    c_out = input.shape[1] // (ph * pw)
    chan = _ps_channels(c_out, ph, pw)
    out = input.new_zeros(k, c_out, ph, pw)
    for r in range(k):
        box = rois[r, 1:] * spatial_scale - 0.5
        if sampling_ratio <= 0:  # the kernel's adaptive grid, unclamped: count 0 gives 0/0
            gh = math.ceil(float(box[3] - box[1]) / ph)
            gw = math.ceil(float(box[2] - box[0]) / pw)
            if gh <= 0 or gw <= 0:
                out[r] = float("nan") if gh * gw == 0 else 0.0
                continue
        full = _align_one(input[int(rois[r, 0])], box, ph, pw, sampling_ratio, clamp_size=False)
        full = full.reshape(c_out, ph * pw, ph, pw)
        ii, jj = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
        out[r] = full[:, ii * pw + jj, ii, jj]
    return out, chan.expand(k, c_out, ph, pw).contiguous()


def ps_roi_pool_ref(input: torch.Tensor, rois: torch.Tensor, spatial_scale: float,
                    pooled_height: int, pooled_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision::ps_roi_pool: position-sensitive average over integer bins."""
    k, ph, pw = rois.shape[0], pooled_height, pooled_width
    n, c, h, w = input.shape
    c_out = c // (ph * pw)
    chan = _ps_channels(c_out, ph, pw)
    out = input.new_zeros(k, c_out, ph, pw)
    for r in range(k):
        image = input[int(rois[r, 0])]
        sw, sh, ew, eh = (_cpp_round(v * spatial_scale) for v in rois[r, 1:].unbind())
        rw, rh = max(ew - sw, 1), max(eh - sh, 1)
        bin_h = torch.tensor(rh / ph, dtype=torch.float32)
        bin_w = torch.tensor(rw / pw, dtype=torch.float32)
        for i in range(ph):  # the forward kernel clips to [0, size - 1] (roi_pool: size)
            hs = min(max(int(torch.floor(i * bin_h)) + sh, 0), h - 1)
            he = min(max(int(torch.ceil((i + 1) * bin_h)) + sh, 0), h - 1)
            for j in range(pw):
                ws = min(max(int(torch.floor(j * bin_w)) + sw, 0), w - 1)
                we = min(max(int(torch.ceil((j + 1) * bin_w)) + sw, 0), w - 1)
                if he <= hs or we <= ws:
                    continue
                region = image[chan[:, i, j].long(), hs:he, ws:we]
                out[r, :, i, j] = region.sum((1, 2)) / ((he - hs) * (we - ws))
    return out, chan.expand(k, c_out, ph, pw).contiguous()


def _deform_corner(flat: torch.Tensor, yy: torch.Tensor, xx: torch.Tensor, valid: torch.Tensor,
                   h: int, w: int) -> torch.Tensor:
    """Values of one bilinear corner: flat [B, G, Cg, H*W], yy/xx/valid [B, G, K] -> [B, G, Cg, K]
    (0 where the corner is outside the image)."""
    ok = valid & (yy >= 0) & (yy <= h - 1) & (xx >= 0) & (xx <= w - 1)
    idx = (yy.clamp(0, h - 1) * w + xx.clamp(0, w - 1))[:, :, None, :]
    vals = torch.gather(flat, 3, idx.expand(-1, -1, flat.shape[2], -1))
    return vals * ok[:, :, None, :].to(flat.dtype)


def _deform_sample(input: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torchvision's deform_conv2d bilinear sampling: input [B, C, H, W], positions y/x
    [B, G, K] (G offset groups) -> [B, G, C/G, K]; 0 outside (-1, H) x (-1, W)."""
    b, c, h, w = input.shape
    g = y.shape[1]
    flat = input.reshape(b, g, c // g, h * w)
    inside = (y > -1) & (y < h) & (x > -1) & (x < w)
    y0, x0 = y.floor(), x.floor()
    ly, lx = y - y0, x - x0
    y0, x0 = y0.long(), x0.long()
    out = 0
    for dy, wy in ((0, 1 - ly), (1, ly)):
        for dx, wx in ((0, 1 - lx), (1, lx)):
            corner = _deform_corner(flat, y0 + dy, x0 + dx, inside, h, w)
            out = out + corner * (wy * wx)[:, :, None, :]
    return out


def deform_conv2d_ref(input: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor,
                      mask: torch.Tensor, bias: torch.Tensor, stride_h: int, stride_w: int,
                      pad_h: int, pad_w: int, dilation_h: int, dilation_w: int, groups: int,
                      offset_groups: int, use_mask: bool) -> torch.Tensor:
    """torchvision::deform_conv2d: offset [B, 2*G*kh*kw, OH, OW] as (dy, dx) per kernel tap and
    offset group G, mask [B, G*kh*kw, OH, OW] (used when ``use_mask``)."""
    b, c, _, _ = input.shape
    oc, _, kh, kw = weight.shape
    oh, ow = offset.shape[-2:]
    g = offset_groups
    off = offset.reshape(b, g, kh, kw, 2, oh, ow)
    dt = input.dtype
    base_y = (torch.arange(oh, dtype=dt) * stride_h - pad_h)[None, :, None] + \
        (torch.arange(kh, dtype=dt) * dilation_h)[:, None, None]  # [kh, OH, 1]
    base_x = (torch.arange(ow, dtype=dt) * stride_w - pad_w)[None, None, :] + \
        (torch.arange(kw, dtype=dt) * dilation_w)[:, None, None]  # [kw, 1, OW]
    y = base_y[None, None, :, None] + off[:, :, :, :, 0]  # [B, G, kh, kw, OH, OW]
    x = base_x[None, None, None, :] + off[:, :, :, :, 1]
    cols = _deform_sample(input, y.reshape(b, g, -1), x.reshape(b, g, -1))
    if use_mask:
        cols = cols * mask.reshape(b, g, 1, -1)
    cols = cols.reshape(b, groups, c // groups, kh, kw, oh, ow)
    wts = weight.reshape(groups, oc // groups, c // groups, kh, kw)
    out = torch.einsum("bgcijhw,gocij->bgohw", cols, wts).reshape(b, oc, oh, ow)
    return out + bias.reshape(1, -1, 1, 1)


def qnms_ref(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """torchvision::qnms: nms of quantized boxes and scores (on their float values)."""
    return nms_ref(dets.dequantize(), scores.dequantize(), iou_threshold)


def _not_written(name: str) -> Callable[..., Any]:
    def kernel(*args: Any) -> Any:
        raise NotImplementedError(
            f"torchvision::{name} has no CPU reference kernel in bench/zoo/torchvision_cpu.py "
            f"(only its schema and shapes): it is not used by inference exports")
    return kernel


REFERENCE: dict[str, Callable[..., Any]] = {
    "nms": nms_ref,
    "qnms": qnms_ref,
    "roi_align": roi_align_ref,
    "roi_pool": roi_pool_ref,
    "ps_roi_align": ps_roi_align_ref,
    "ps_roi_pool": ps_roi_pool_ref,
    "deform_conv2d": deform_conv2d_ref,
}


# ---------------------------------------------------------------------------------------------
# fake (shape) kernels, as torchvision's _meta_registrations.py
# ---------------------------------------------------------------------------------------------

def _fake_nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    torch._check(dets.dim() == 2 and dets.size(1) == 4, lambda: "boxes should be [N, 4]")
    torch._check(scores.dim() == 1 and scores.size(0) == dets.size(0),
                 lambda: "scores should be [N] for boxes [N, 4]")
    n = torch.library.get_ctx().new_dynamic_size()
    return dets.new_empty(n, dtype=torch.long)


def _fake_roi_align(input, rois, spatial_scale, ph, pw, sampling_ratio, aligned):
    torch._check(rois.size(1) == 5, lambda: "rois must have shape as Tensor[K, 5]")
    return input.new_empty((rois.size(0), input.size(1), ph, pw))


def _fake_qroi_align(input, rois, input_scale, input_zp, rois_scale, rois_zp, spatial_scale, ph,
                     pw, sampling_ratio, aligned):
    return input.new_empty((rois.size(0), input.size(1), ph, pw))


def _fake_pair(input, rois, ph, pw, channels):
    shape = (rois.size(0), channels, ph, pw)
    return input.new_empty(shape), input.new_empty(shape, dtype=torch.int32)


FAKES: dict[str, Callable[..., Any]] = {
    "roi_align": _fake_roi_align,
    "qroi_align": _fake_qroi_align,
    "roi_pool": lambda input, rois, s, ph, pw: _fake_pair(input, rois, ph, pw, input.size(1)),
    "ps_roi_pool": lambda input, rois, s, ph, pw: _fake_pair(input, rois, ph, pw,
                                                             input.size(1) // (ph * pw)),
    "ps_roi_align": lambda input, rois, s, ph, pw, sr: _fake_pair(input, rois, ph, pw,
                                                                  input.size(1) // (ph * pw)),
    "deform_conv2d": lambda input, weight, offset, *rest: input.new_empty(
        (input.size(0), weight.size(0), offset.size(-2), offset.size(-1))),
    "_roi_align_backward": lambda grad, rois, s, ph, pw, b, c, h, w, *rest: grad.new_empty(
        (b, c, h, w)),
    "_ps_roi_align_backward": lambda grad, rois, cm, s, ph, pw, sr, b, c, h, w: grad.new_empty(
        (b, c, h, w)),
    "_roi_pool_backward": lambda grad, rois, am, s, ph, pw, b, c, h, w: grad.new_empty(
        (b, c, h, w)),
    "_ps_roi_pool_backward": lambda grad, rois, cm, s, ph, pw, b, c, h, w: grad.new_empty(
        (b, c, h, w)),
    "box_iou_rotated": lambda a, b: a.new_empty((a.size(0), b.size(0))),
}


# ---------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------

def _real_extension_loads() -> bool:
    """Whether torchvision is installed and its own ``_C`` extension loads next to this torch."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        for name in os.listdir(folder):
            if name.startswith("_C.") and name.endswith((".so", ".pyd")):
                try:
                    torch.ops.load_library(os.path.join(folder, name))
                    return True
                except OSError:
                    return False
    return False


def _define(with_nms_fakes: bool) -> None:
    global _LIB
    _LIB = torch.library.Library("torchvision", "DEF")  # noqa: TOR901 - the namespace is ours
    for schema in SCHEMAS.values():
        _LIB.define(schema)
    for name in SCHEMAS:
        if name == "_cuda_version":
            _LIB.impl(name, lambda: -1, "CompositeExplicitAutograd")
            continue
        _LIB.impl(name, REFERENCE.get(name) or _not_written(name), "CPU")
    for name, fake in FAKES.items():
        torch.library.register_fake(f"torchvision::{name}", fake, lib=_LIB)
    if with_nms_fakes:  # else torchvision's own _meta_registrations registers them
        for name in ("nms", "qnms"):
            torch.library.register_fake(f"torchvision::{name}", _fake_nms, lib=_LIB)


def _mark_ops_loaded() -> None:
    """torchvision's Python ops check ``_has_ops()`` (bound by name in several modules)."""
    import sys

    import torchvision.extension as ext

    original = ext._has_ops

    def has_ops() -> bool:
        return True

    for name, mod in list(sys.modules.items()):
        if name.startswith("torchvision") and getattr(mod, "_has_ops", None) is original:
            mod._has_ops = has_ops


def install(import_torchvision: bool = True) -> str:
    """Make the ``torchvision::*`` ops usable on this CPU; then import torchvision if installed.

    Returns how: "real" (torchvision's own extension loaded), "shim" (ops defined here, with
    torchvision imported on top when ``import_torchvision`` and it is installed) or "installed"
    (a second call). Call it before anything imports torchvision."""
    if _STATE["installed"]:
        return "installed"
    _STATE["installed"] = True
    has_tv = importlib.util.find_spec("torchvision") is not None
    if has_tv and _real_extension_loads():
        _STATE["real_ops"] = True
        if import_torchvision:
            import torchvision  # noqa: F401
        return "real"
    will_import = has_tv and import_torchvision
    _define(with_nms_fakes=not will_import)
    if will_import:
        import torchvision  # noqa: F401

        _mark_ops_loaded()
    logger.debug("torchvision ops defined with CPU reference kernels")
    return "shim"


def real_ops() -> bool:
    """Whether the ``torchvision::*`` ops are torchvision's own (its extension loaded)."""
    return bool(_STATE["real_ops"])
