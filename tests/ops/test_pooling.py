"""Pooling and resampling: adaptive max pooling (1-3 d, indices), 3-d adaptive average pooling,
fractional max pooling, average pooling with divisor_override, anti-aliased bilinear/bicubic
upsampling, CTC loss (int or tensor lengths, every reduction).

OpInfo samples plus edge values (NaN, +-inf, ties, all -inf windows, empty batches, unbatched
inputs, windows of uneven length, up- and downsampling), against PyTorch. Indices are compared
exactly. Each sample costs one export (~1 s), so edge values are batched into few tensors.

What plain torch.onnx 2.13 does is pinned by test_plain_torch_onnx_*: a translated op must
still be missing or wrong there (else the translation is dead weight), and the pooling ops it
already gets right (grid_sample 3-d, lp_pool, max_unpool, adaptive_avg_pool 1-d/2-d) stay
untranslated.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import onnxmedic
from onnxmedic.ops.testing import check_call
from tests.ops._table import OpEntry, make_tests, opinfo_samples

nan, inf = math.nan, math.inf
TOL = {"float32": (1e-5, 1e-5), "float64": (1e-10, 1e-10)}


def _special(shape, dtype, seed=0):
    """Random values with ties, NaN, +-inf and a few all -inf stretches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).to(dtype)
    flat = x.view(-1)
    n = flat.numel()
    r = torch.rand(n, generator=g)
    flat[r < 0.06] = nan
    flat[(r >= 0.06) & (r < 0.12)] = inf
    flat[(r >= 0.12) & (r < 0.25)] = -inf
    flat[: min(n, 7)] = -inf  # an all -inf corner window
    return x


# -- adaptive max pooling -----------------------------------------------------------------------

def _adaptive_max_edges(k):
    fn_sizes = {1: ((2, 3, 11), (4,)), 2: ((2, 3, 11, 7), (4, 5)), 3: ((1, 2, 7, 5, 6), (3, 2, 4))}

    def edge(dtype):
        shape, out = fn_sizes[k]
        x = _special(shape, dtype)
        up = tuple(s + 3 for s in shape[2:])  # more outputs than inputs: overlapping windows
        smooth = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        return [((x, out, True), {}), ((x[0], out, True), {}), ((smooth, up, True), {}),
                ((x[:0], out, True), {})]
    return edge


# -- fractional max pooling ---------------------------------------------------------------------

def _with_samples(k, seed=0):
    """OpInfo's fractional_max_pool samples draw their intervals at random inside the op; give
    each one fixed ``_random_samples`` (what the op's random draw would feed) instead."""
    def edge(dtype):
        g = torch.Generator().manual_seed(seed)
        name = f"nn.functional.fractional_max_pool{k}d"
        picks = opinfo_samples(name, "", dtype, 36)[3::8]  # return_indices=True, varied kernels
        out = []
        for args, kwargs in picks:
            x = args[0]
            samples = torch.rand(x.shape[0] if x.dim() == k + 2 else 1, x.shape[-k - 1], k,
                                 generator=g).to(dtype)
            out.append((args, {**kwargs, "_random_samples": samples}))
        shape = (2, 3, 11, 9) if k == 2 else (1, 2, 8, 7, 9)
        x = _special(shape, dtype, seed=2)
        s = torch.rand(shape[0], shape[1], k, generator=g).to(dtype)
        sizes = (5, 4) if k == 2 else (4, 3, 5)
        out.append(((x, 2), {"output_size": sizes, "_random_samples": s, "return_indices": True}))
        out.append(((x, 3), {"output_size": 1, "_random_samples": s, "return_indices": True}))
        out.append(((x[0], 2), {"output_size": sizes, "_random_samples": s[:1],
                                "return_indices": True}))
        out.append(((x[:0], 2), {"output_size": sizes, "_random_samples": s[:0],
                                 "return_indices": True}))  # empty batch
        return out
    return edge


# -- average pooling ----------------------------------------------------------------------------

def _avg_pool_edges(k):
    def edge(dtype):
        shape = (2, 3, 9, 8) if k == 2 else (1, 2, 7, 6, 5)
        x = _special(shape, dtype, seed=3)
        smooth = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        return [
            ((smooth, 3, 2, 1, True, True, 5), {}),  # ceil mode + padding + divisor_override
            ((smooth, 3, 2, 1, True, False, None), {}),
            ((smooth, 2, 3, 1, True, True, None), {}),  # windows past the padded edge
            ((smooth[0], 2, 1, 0, False, True, -3), {}),  # unbatched, negative divisor
            ((x, 3, 2, 1, False, True, 2), {}),  # inf/NaN stay in their windows
            ((x[:0], 3, 2, 1, False, True, 2), {}),  # empty batch
        ]
    return edge


def _adaptive_avg3d_edges(dtype):
    x = _special((1, 2, 7, 5, 6), dtype, seed=5)
    smooth = torch.randn(2, 3, 9, 4, 7, generator=torch.Generator().manual_seed(6)).to(dtype)
    return [((x, (3, 2, 4)), {}), ((smooth, (4, 7, 3)), {}), ((smooth[0], (9, 1, 2)), {})]


# -- anti-aliased upsampling --------------------------------------------------------------------

def _aa(mode):
    def fn(x, size=None, scale_factor=None, align_corners=False):
        return F.interpolate(x, size=size, scale_factor=scale_factor, mode=mode,
                             align_corners=align_corners, antialias=True)
    return fn


def _aa_edges(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 17, 12, generator=g).to(dtype)
    special = x.clone()
    special[0, 0, 3, 4] = inf
    special[1, 2, 10, 1] = nan
    return [((x, (5, 7)), {}), ((x, (5, 7)), {"align_corners": True}),
            ((x, (30, 25)), {"align_corners": True}), ((x, (30, 5)), {}),
            ((x,), {"scale_factor": 0.35}), ((x,), {"scale_factor": (1.7, 0.45)}),
            ((x, (1, 1)), {"align_corners": True}), ((special, (6, 5)), {}),
            ((torch.randn(1, 4, 64, 61, generator=g).to(dtype), (13, 100)), {}),  # larger
            ((x[0], (4, 9)), {})]


# -- CTC loss -----------------------------------------------------------------------------------

def _ctc(log_probs, targets, input_lengths, target_lengths, **kwargs):
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, **kwargs)


def _ctc_edges(dtype):
    g = torch.Generator().manual_seed(11)
    lp = torch.randn(12, 3, 6, generator=g, dtype=dtype).log_softmax(2)
    tg = torch.tensor([[1, 2, 2, 5], [3, 3, 0, 0], [4, 1, 4, 0]])
    flat = torch.tensor([1, 2, 2, 5, 3, 3, 4, 1, 4])
    return [
        ((lp, tg, [12, 9, 7], [4, 2, 3]), {"reduction": "none"}),  # repeated labels
        ((lp, tg, [12, 9, 2], [4, 0, 3]), {"reduction": "sum"}),  # infeasible -> inf
        ((lp, tg, [12, 9, 2], [4, 0, 3]), {"reduction": "none", "zero_infinity": True}),
        ((lp, tg.int(), [12, 9, 7], [4, 2, 3]), {"reduction": "none", "blank": 3}),
        ((lp, flat, [12, 9, 7], [4, 2, 3]), {"reduction": "none"}),  # concatenated targets
        ((lp, torch.zeros(3, 0, dtype=torch.long), [12, 5, 1], [0, 0, 0]), {"reduction": "none"}),
        ((lp[:, 0], tg[0], [12], [4]), {"reduction": "none"}),  # unbatched
    ]


def _ctc_mean_and_tensor_lengths(dtype):
    """reduction='mean' and tensor lengths: torch.export failed on both before onnxmedic
    registered Python replays of ctc_loss's composite (see pooling.py)."""
    g = torch.Generator().manual_seed(12)
    lp = torch.randn(8, 3, 5, generator=g, dtype=dtype).log_softmax(2)
    tg = torch.tensor([[1, 2, 2], [3, 4, 0], [4, 4, 4]])
    flat = torch.tensor([1, 2, 2, 3, 4, 4, 4, 4])

    def lens(*v, dt=torch.long):
        return torch.tensor(v, dtype=dt)

    return [
        ((lp, tg, [8, 6, 5], [3, 2, 0]), {"reduction": "mean"}),  # an empty target
        ((lp, tg, [8, 2, 5], [3, 2, 3]), {"reduction": "mean", "zero_infinity": True}),
        ((lp, tg, lens(8, 6, 5), lens(3, 2, 0)), {"reduction": "none"}),
        ((lp, tg, lens(8, 6, 5), lens(3, 2, 0)), {"reduction": "mean"}),
        ((lp, tg, lens(8, 2, 6), lens(3, 2, 3)), {"reduction": "none"}),  # infeasible: inf
        ((lp, tg, lens(8, 2, 6), lens(3, 2, 3)), {"reduction": "sum", "zero_infinity": True}),
        ((lp, tg.int(), lens(8, 7, 6, dt=torch.int32), lens(3, 1, 3, dt=torch.int32)),
         {"reduction": "none", "blank": 4}),
        ((lp, flat, lens(8, 6, 5), lens(3, 2, 3)), {"reduction": "none"}),  # concatenated
        ((lp, flat[:5], lens(8, 6, 5), lens(3, 0, 2)), {"reduction": "mean"}),
        ((lp[:, 0], tg[0], [8], [3]), {"reduction": "mean"}),  # unbatched
    ]


F64 = (torch.float64,)


def _first(edge, n):
    return lambda dtype: edge(dtype)[:n]


ENTRIES = [
    OpEntry("nn.functional.adaptive_max_pool1d", tolerance=TOL, edge=_adaptive_max_edges(1),
            max_samples=3),
    OpEntry("nn.functional.adaptive_max_pool2d", tolerance=TOL, edge=_adaptive_max_edges(2),
            max_samples=4),
    OpEntry("nn.functional.adaptive_max_pool2d", tolerance=TOL, dtypes=F64, use_opinfo=False,
            edge=_first(_adaptive_max_edges(2), 2)),
    OpEntry("nn.functional.adaptive_max_pool3d", tolerance=TOL, edge=_adaptive_max_edges(3),
            max_samples=3),
    OpEntry("nn.functional.adaptive_avg_pool3d", tolerance=TOL, edge=_adaptive_avg3d_edges,
            max_samples=3),
    OpEntry("nn.functional.adaptive_avg_pool3d", tolerance=TOL, dtypes=F64, use_opinfo=False,
            edge=_first(_adaptive_avg3d_edges, 1)),
    OpEntry("nn.functional.fractional_max_pool2d", tolerance=TOL, use_opinfo=False,
            edge=_with_samples(2)),
    OpEntry("nn.functional.fractional_max_pool2d", tolerance=TOL, dtypes=F64, use_opinfo=False,
            edge=lambda d: _with_samples(2)(d)[-3:-1]),
    OpEntry("nn.functional.fractional_max_pool3d", tolerance=TOL, use_opinfo=False,
            edge=_with_samples(3)),
    OpEntry("nn.functional.avg_pool2d", tolerance=TOL, edge=_avg_pool_edges(2), max_samples=4),
    OpEntry("nn.functional.avg_pool2d", tolerance=TOL, dtypes=F64, use_opinfo=False,
            edge=_first(_avg_pool_edges(2), 2)),
    OpEntry("nn.functional.avg_pool3d", tolerance=TOL, edge=_avg_pool_edges(3), max_samples=3),
    OpEntry("_upsample_bilinear2d_aa", tolerance=TOL, max_samples=4),
    OpEntry("interpolate.bilinear_aa", fn=_aa("bilinear"), tolerance=TOL, use_opinfo=False,
            edge=_aa_edges),
    OpEntry("interpolate.bilinear_aa", fn=_aa("bilinear"), tolerance=TOL, use_opinfo=False,
            dtypes=F64, edge=lambda d: _aa_edges(d)[1:3]),
    OpEntry("interpolate.bicubic_aa", fn=_aa("bicubic"), tolerance=TOL, use_opinfo=False,
            edge=_aa_edges),
    # OpInfo's samples are T=50 (an unrolled 50-step recursion, slow to export): take one
    # samples 0-3: int and tensor lengths (T=50, 16 sequences)
    OpEntry("nn.functional.ctc_loss", fn=_ctc, tolerance=TOL, max_samples=4, edge=_ctc_edges),
    # every 7th OpInfo sample (all modes; some are large) plus nearest/reflection
    OpEntry("grid_sampler_3d", tolerance=TOL, use_opinfo=False,
            edge=lambda d: opinfo_samples("grid_sampler_3d", "", d, 30)[::7] + [
                ((torch.randn(2, 3, 5, 4, 6, dtype=d),
                  torch.rand(2, 3, 2, 4, 3, dtype=d) * 2.6 - 1.3, 1, 2, True), {})]),
    OpEntry("nn.functional.ctc_loss", fn=_ctc, tolerance=TOL, dtypes=F64, use_opinfo=False,
            edge=lambda d: _ctc_edges(d)[:2]),
    OpEntry("ctc_loss.mean_or_tensor_lengths", fn=_ctc, tolerance=TOL, use_opinfo=False,
            dtypes=(torch.float32, torch.float64), edge=_ctc_mean_and_tensor_lengths),
]

make_tests(ENTRIES, globals())


# -- what plain torch.onnx does -----------------------------------------------------------------

_x2 = torch.randn(2, 3, 10, 9, generator=torch.Generator().manual_seed(8))
_x3 = torch.randn(1, 2, 7, 6, 5, generator=torch.Generator().manual_seed(9))

PLAIN_FAILS = {
    # op: (call, args, stage where plain torch.onnx fails)
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (4, 5), return_indices=True),
                            (_x2,), "export"),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, (3, 4, 2)), (_x3,), "export"),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, (3, 4, 2)), (_x3,), "export"),
    "fractional_max_pool2d": (
        lambda x, s: F.fractional_max_pool2d(x, 2, output_size=(5, 4), _random_samples=s),
        (_x2, torch.rand(2, 3, 2)), "export"),
    "fractional_max_pool3d": (
        lambda x, s: F.fractional_max_pool3d(x, 2, output_size=(4, 3, 3), _random_samples=s),
        (_x3, torch.rand(1, 2, 3)), "export"),
    "avg_pool2d.divisor_override": (lambda x: F.avg_pool2d(x, 3, 2, 1, divisor_override=2),
                                    (_x2,), "compare"),
    # torchlib's AveragePool has no float64 kernel in ONNX Runtime
    "avg_pool2d.float64": (lambda x: F.avg_pool2d(x, 3, 2, 1), (_x2.double(),), "runtime"),
    "avg_pool3d.divisor_override": (lambda x: F.avg_pool3d(x, 2, divisor_override=3), (_x3,),
                                    "compare"),
    "upsample_bilinear_aa.align_corners": (
        lambda x: _aa("bilinear")(x, (4, 5), align_corners=True), (_x2,), "compare"),
    "upsample_bilinear_aa.scale_factor": (
        lambda x: _aa("bilinear")(x, scale_factor=0.35), (_x2,), "compare"),
    "upsample_bicubic_aa.align_corners": (
        lambda x: _aa("bicubic")(x, (4, 5), align_corners=True), (_x2,), "compare"),
    # torch.export fails (DynamicOutputShapeException) unless ops.pooling's fake kernel for
    # aten::_ctc_loss is loaded; with it, plain torchlib has no translation
    "grid_sampler_3d": (lambda x, g: torch.grid_sampler_3d(x, g, 0, 1, False),
                        (_x3, torch.rand(1, 3, 4, 2, 3) * 2.4 - 1.2), "export"),
    "ctc_loss": (lambda a, t: F.ctc_loss(a, t, [10, 9], [3, 2], reduction="none"),
                 (torch.randn(10, 2, 5).log_softmax(2), torch.tensor([[1, 2, 2], [3, 4, 0]])),
                 "export"),
}


@pytest.mark.parametrize("name", list(PLAIN_FAILS))
def test_plain_torch_onnx_fails_onnxmedic_passes(name):
    fn, args, stage = PLAIN_FAILS[name]
    plain = check_call(fn, args, registry=None, tolerance=(1e-5, 1e-5))
    assert plain.stage == stage, (plain.stage, plain.error)
    ours = check_call(fn, args, tolerance=(1e-5, 1e-5))
    assert ours.ok, ours.error


PLAIN_OK = {
    "grid_sample_3d.bilinear.zeros": (
        lambda x, g: F.grid_sample(x, g, align_corners=False), (_x3, torch.rand(1, 3, 4, 2, 3) * 2.4 - 1.2)),
    "grid_sample_3d.nearest.reflection": (
        lambda x, g: F.grid_sample(x, g, mode="nearest", padding_mode="reflection",
                                   align_corners=True), (_x3, torch.rand(1, 3, 4, 2, 3) * 3 - 1.5)),
    "lp_pool2d.p1.5.ceil": (lambda x: F.lp_pool2d(x.abs(), 1.5, 3, 2, ceil_mode=True), (_x2,)),
    "lp_pool3d.p2": (lambda x: F.lp_pool3d(x, 2, 2), (_x3,)),
    "lp_pool1d.inf_and_p1": (lambda x: (F.lp_pool1d(x, inf, 3), F.lp_pool1d(x, 1, 2, 3)),
                             (_x2[0],)),
    "max_unpool1d_2d_3d": (lambda x, z: (
        F.max_unpool2d(*F.max_pool2d(x, 3, 2, return_indices=True), 3, 2, output_size=(10, 9)),
        F.max_unpool1d(*F.max_pool1d(x[0], 2, return_indices=True), 2),
        F.max_unpool3d(*F.max_pool3d(z[..., :6, :4], 2, return_indices=True), 2)), (_x2, _x3)),
    "adaptive_avg_pool2d.uneven": (lambda x: F.adaptive_avg_pool2d(x, (4, 5)), (_x2,)),
    "adaptive_max_pool2d.divisible": (lambda x: F.adaptive_max_pool2d(x, (5, 3)), (_x2,)),
}


@pytest.mark.parametrize("name", list(PLAIN_OK))
def test_plain_torch_onnx_already_handles(name):
    """Pooling ops torchlib gets right (so onnxmedic does not translate them)."""
    fn, args = PLAIN_OK[name]
    res = check_call(fn, args, registry=None, tolerance=(1e-5, 1e-5))
    assert res.ok, res.error


# -- end to end ---------------------------------------------------------------------------------

class _PoolNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.amax = torch.nn.AdaptiveMaxPool2d((3, 5), return_indices=True)
        self.avg = torch.nn.AvgPool2d(3, 2, 1, ceil_mode=True, divisor_override=4)
        self.amax3 = torch.nn.AdaptiveMaxPool3d((2, 3, 2))

    def forward(self, x, samples):
        y = self.conv(x)
        m, idx = self.amax(y)
        a = self.avg(y)
        f = F.fractional_max_pool2d(y, 2, output_size=(4, 3), _random_samples=samples)
        u = F.interpolate(y, size=(5, 4), mode="bilinear", antialias=True, align_corners=True)
        v = F.adaptive_avg_pool3d(y.unsqueeze(1), (3, 4, 2))
        w = self.amax3(y.unsqueeze(1))
        lp = m.flatten(2).permute(2, 0, 1).log_softmax(-1)  # (T=15, B=2, C=4)
        c = F.ctc_loss(lp, torch.tensor([[1, 2, 2], [3, 1, 0]]), [15, 11], [3, 2],
                       reduction="sum")
        return m, idx, a, f, u, v, w, c


def test_module_end_to_end():
    model = _PoolNet().eval()
    args = (torch.randn(2, 3, 11, 9), torch.rand(2, 4, 2))
    result = onnxmedic.export(model, args)
    assert result.ok, [f.message for f in result.findings]
    plain = check_call(model, args, registry=None)
    assert not plain.ok  # torch.onnx alone cannot export it


class _DynamicSpatial(torch.nn.Module):
    def forward(self, x):
        return (F.avg_pool2d(x, 3, 2, 1),
                F.interpolate(x, size=(5, 4), mode="bilinear", antialias=True))


def test_dynamic_spatial_sizes_keep_working():
    """avg_pool2d and the AA upsample override torchlib; where torchlib is right (no
    divisor_override; align_corners=False, no scales) they still export with dynamic H, W."""
    h = torch.export.Dim("h", min=4, max=64)
    w = torch.export.Dim("w", min=4, max=64)
    result = onnxmedic.export(_DynamicSpatial().eval(), (torch.randn(2, 3, 11, 9),),
                              dynamic_shapes={"x": {2: h, 3: w}})
    assert result.ok, [f.message for f in result.findings]


def test_ctc_decomposition_keeps_gradients():
    """The Python replays of ctc_loss (registered for tracing; torch.compile would trace them
    too) must give PyTorch's loss and gradient: with tensor lengths the losses come from the
    custom op onnxmedic::ctc_nll, whose backward is PyTorch's _ctc_loss_backward."""
    import warnings

    import onnxmedic.ops.pooling  # noqa: F401 - registers the replays

    key = torch._C.DispatchKey.CompositeImplicitAutograd
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(8, 3, 5, generator=g, dtype=torch.float64).log_softmax(2)
    tg = torch.tensor([[1, 2, 2], [3, 4, 0], [4, 4, 4]])
    for target, lengths in ((torch.ops.aten.ctc_loss.IntList, ([8, 6, 5], [3, 2, 0])),
                            (torch.ops.aten.ctc_loss.Tensor,
                             (torch.tensor([8, 6, 5]), torch.tensor([3, 2, 0])))):
        replay = target.py_kernels[key]
        for reduction in (0, 1, 2):  # none, mean, sum
            x = lp.detach().requires_grad_()
            ref = target(x, tg, *lengths, 0, reduction, True)
            (g_ref,) = torch.autograd.grad(ref.sum(), x)
            with warnings.catch_warnings():  # torch warns when a custom op has no autograd
                warnings.simplefilter("error")
                ours = replay(x, tg, *lengths, 0, reduction, True)
                (g_ours,) = torch.autograd.grad(ours.sum(), x)
            torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)
