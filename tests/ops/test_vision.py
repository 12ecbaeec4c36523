"""torchvision's detection ops (nms, roi_align, roi_pool, deform_conv2d) against the CPU reference
kernels of bench/zoo/torchvision_cpu.py, which defines the ops when torchvision's own extension
does not load (and leaves torchvision's real ops in place where it does). Edge tables: no boxes,
all boxes suppressed, equal scores, boxes partly or wholly outside the image, empty bins."""

from __future__ import annotations

import torch

from bench.zoo.torchvision_cpu import install
from onnxmedic.ops import REGISTRY
from tests.ops._table import OpEntry, make_tests

install()
tv = torch.ops.torchvision


def _boxes(n: int, g: torch.Generator, scale: float = 50.0) -> torch.Tensor:
    xy = torch.rand(n, 2, generator=g) * scale
    wh = torch.rand(n, 2, generator=g) * scale / 2 + 0.5
    return torch.cat([xy, xy + wh], 1)


def _nms_samples(dtype: torch.dtype):
    """Random boxes, no boxes, one box, all suppressed (identical boxes), equal scores in
    overlapping and disjoint boxes (ties: the lower index first), zero-area boxes, IoU exactly at
    the threshold (kept: suppression is IoU > threshold), boxes outside the image."""
    g = torch.Generator().manual_seed(0)
    rnd = _boxes(60, g)
    same = torch.tensor([[1.0, 2.0, 11.0, 12.0]]).repeat(5, 1)
    ties = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 10.5]])
    half = torch.tensor([[0, 0, 10, 10], [0, 0, 10, 5.0], [5, 0, 15, 10]])  # IoU 0.5, 1/3
    outside = torch.tensor([[-30, -30, -10, -10], [100, 100, 140, 150], [-5, -5, 3, 3.0]])
    flat = torch.tensor([[3, 3, 3, 9], [3, 3, 3, 9], [0, 0, 4, 4.0]])
    cases = [(rnd, torch.rand(60, generator=g)), (torch.zeros(0, 4), torch.zeros(0)),
             (rnd[:1], torch.ones(1)), (same, torch.rand(5, generator=g)),
             (ties, torch.ones(4)), (ties, torch.tensor([0.5, 0.9, 0.9, 0.5])),
             (half, torch.tensor([0.9, 0.8, 0.7])), (outside, torch.rand(3, generator=g)),
             (flat, torch.rand(3, generator=g))]
    return [((b.to(dtype), s.to(dtype)), {}) for b, s in cases]


def _rois(dtype: torch.dtype):
    """Feature maps [2, 4, 12, 16] and RoIs: inside, overlapping every edge, wholly outside,
    degenerate (zero width/height), reversed corners, one per batch image; and no RoIs."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 12, 16, generator=g, dtype=dtype)
    rois = torch.tensor([[0, 2, 2, 20, 14], [1, -6, -4, 9, 7], [0, 20, 10, 40, 30],
                         [1, 28, 18, 30, 22], [0, 40, 40, 60, 50], [1, 5, 5, 5, 9],
                         [0, 12, 8, 4, 2], [1, 0, 0, 32, 24]], dtype=dtype)
    return [((x, rois), {}), ((x, rois[:0]), {}), ((x, rois[:1]), {})]


def _deform(dtype: torch.dtype):
    """Offsets that move samples inside and outside the image, with and without a mask, stride,
    padding, dilation, weight groups and offset groups."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 9, 11, generator=g, dtype=dtype)
    w = torch.randn(6, 2, 3, 3, generator=g, dtype=dtype)
    off = torch.randn(2, 2 * 2 * 9, 5, 6, generator=g, dtype=dtype) * 4
    mask = torch.rand(2, 2 * 9, 5, 6, generator=g, dtype=dtype)
    return [((x, w, off, mask), {})]


def _nms(b, s):
    return tv.nms(b, s, 0.5)


def _nms_low(b, s):
    return tv.nms(b, s, 0.0)


def _batched_nms(b, s):
    """torchvision.ops.batched_nms's coordinate trick (its path for export), classes 0..2."""
    idxs = torch.arange(b.shape[0]) % 3
    offsets = idxs.to(b) * (b.max() + 1)
    return tv.nms(b + offsets[:, None], s, 0.5)


def _roi_align(x, r):
    return tv.roi_align(x, r, 0.5, 3, 4, -1, False)


def _roi_align_aligned(x, r):
    return tv.roi_align(x, r, 0.5, 3, 4, 2, True)


def _roi_align_sr1(x, r):
    return tv.roi_align(x, r, 0.25, 2, 2, 1, False)


def _roi_pool(x, r):
    return tv.roi_pool(x, r, 0.5, 3, 4)[0]


def _deform_conv(x, w, off, mask):
    bias = torch.arange(w.shape[0], dtype=x.dtype)
    return tv.deform_conv2d(x, w, off, mask, bias, 2, 2, 1, 1, 1, 1, 2, 2, True)


def _deform_conv_nomask(x, w, off, mask):
    bias = torch.zeros(w.shape[0], dtype=x.dtype)
    return tv.deform_conv2d(x, w, off, mask, bias, 1, 2, 0, 1, 2, 1, 2, 2, False)


def _few(sample) -> str | None:
    """batched_nms's trick takes the max over the boxes: not of an empty set."""
    return "no boxes" if sample[0][0].shape[0] == 0 else None


F32 = (torch.float32,)
ENTRIES = [
    OpEntry("nms", fn=_nms, dtypes=F32, use_opinfo=False, edge=_nms_samples),
    OpEntry("nms_iou0", fn=_nms_low, dtypes=F32, use_opinfo=False, edge=_nms_samples),
    OpEntry("batched_nms", fn=_batched_nms, dtypes=F32, use_opinfo=False, edge=_nms_samples,
            skip_sample=_few),
    OpEntry("roi_align", fn=_roi_align, dtypes=F32, use_opinfo=False, edge=_rois),
    OpEntry("roi_align_aligned", fn=_roi_align_aligned, dtypes=F32, use_opinfo=False,
            edge=_rois),
    OpEntry("roi_align_sr1", fn=_roi_align_sr1, dtypes=F32, use_opinfo=False, edge=_rois),
    OpEntry("roi_pool", fn=_roi_pool, dtypes=F32, use_opinfo=False, edge=_rois),
    OpEntry("deform_conv2d", fn=_deform_conv, dtypes=F32, use_opinfo=False, edge=_deform,
            tolerance={"float32": (1e-4, 1e-4)}),
    OpEntry("deform_conv2d_nomask", fn=_deform_conv_nomask, dtypes=F32, use_opinfo=False,
            edge=_deform, tolerance={"float32": (1e-4, 1e-4)}),
]
make_tests(ENTRIES, globals())


def test_translations_are_onnxmedics() -> None:
    """The entries wait for torchvision to define its ops, then are onnxmedic's; roi_pool's
    overrides torchlib's, which reads the Python API's arguments, not the op's."""
    for name in ("nms", "roi_align", "roi_pool", "deform_conv2d"):
        meta = REGISTRY.get(f"torchvision::{name}")
        assert meta is not None and meta.family == "vision", name
        assert meta.overrides_torchlib == (name == "roi_pool"), name


class _PositionSensitive(torch.nn.Module):
    def forward(self, x: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:
        return tv.ps_roi_align(x, rois, 0.5, 2, 2, 2)[0] + 1


def test_position_sensitive_pooling_says_it_has_no_onnx_form() -> None:
    """ps_roi_align has no ONNX operator: OM220 names it and the way out, not a bare OM201."""
    import onnxmedic

    x = torch.randn(1, 8, 10, 10)
    rois = torch.tensor([[0, 1.0, 1.0, 12.0, 14.0]])
    res = onnxmedic.export(_PositionSensitive(), (x, rois))
    codes = [f.code for f in res.findings]
    assert not res.ok and "OM220" in codes and "OM201" not in codes, codes
    f = next(f for f in res.findings if f.code == "OM220")
    assert "position-sensitive" in f.message and "roi_align" in f.suggestion
    assert res.exit_code == 1


def _roi_align_by_sample(x: torch.Tensor, rois: torch.Tensor, scale: float, ph: int, pw: int,
                         ratio: int, aligned: bool) -> torch.Tensor:
    """torchvision's CPU roi_align (csrc/ops/cpu/roi_align_kernel.cpp) sample by sample: each
    bin the average of its grid's bilinear samples, each sample four corners' weighted sum."""
    import math

    h, w = x.shape[-2:]
    out = torch.zeros(rois.shape[0], x.shape[1], ph, pw, dtype=torch.float64)
    off = 0.5 if aligned else 0.0

    def taps(p: float, size: int) -> tuple[int, int, float, float] | None:
        if p < -1.0 or p > size:
            return None
        p = max(p, 0.0)
        low = int(p)
        if low >= size - 1:
            return size - 1, size - 1, 1.0, 0.0
        return low, low + 1, 1.0 - (p - low), p - low

    for k, (b, x1, y1, x2, y2) in enumerate(rois.double().tolist()):
        x1, y1, x2, y2 = (v * scale - off for v in (x1, y1, x2, y2))
        rw, rh = x2 - x1, y2 - y1
        if not aligned:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        gh = ratio if ratio > 0 else math.ceil(rh / ph)
        gw = ratio if ratio > 0 else math.ceil(rw / pw)
        for i in range(ph):
            for j in range(pw):
                for a in range(max(gh, 0)):
                    for c in range(max(gw, 0)):
                        ty = taps(y1 + i * rh / ph + (a + 0.5) * rh / ph / gh, h)
                        tx = taps(x1 + j * rw / pw + (c + 0.5) * rw / pw / gw, w)
                        if ty is None or tx is None:
                            continue
                        for yy, wy in ((ty[0], ty[2]), (ty[1], ty[3])):
                            for xx, wx in ((tx[0], tx[2]), (tx[1], tx[3])):
                                out[k, :, i, j] += wy * wx * x[int(b), :, yy, xx].double()
                out[k, :, i, j] /= max(gh * gw, 1)
    return out


def test_roi_align_reference_kernel_samples_as_torchvision() -> None:
    """The reference kernel (bins' grids of weights summed, then one product per RoI) equals
    torchvision's sample-by-sample computation on the edge RoIs, in each sampling mode."""
    from bench.zoo.torchvision_cpu import roi_align_ref

    (x, rois), _ = _rois(torch.float64)[0]
    for args in ((0.5, 3, 4, -1, False), (0.5, 3, 4, 2, True), (0.25, 2, 2, 1, False),
                 (0.5, 3, 4, 0, True)):
        got = roi_align_ref(x, rois, *args)
        want = _roi_align_by_sample(x, rois, *args)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=str(args))
