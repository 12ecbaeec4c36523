"""Complex-valued translations (onnxmedic.ops.complex), checked against PyTorch.

ONNX graph inputs and outputs cannot be complex (torch.onnx represents them as real tensors
with a trailing (real, imag) dim), so each op is called between view_as_complex and
view_as_real on real tensors. Edge values: inf, nan and -0.0 parts, a zero, empty tensors.
"""

from __future__ import annotations

import torch

import onnxmedic
from onnxmedic.ops.testing import check_call
from tests.ops._table import OpEntry, make_tests

C = torch.view_as_complex
R = torch.view_as_real
F32 = (torch.float32, torch.float64)


def _pairs(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(*shape, 2, generator=g, dtype=dtype)


def _edge_pairs(dtype: torch.dtype) -> torch.Tensor:
    """(real, imag) pairs with inf, nan, -0.0 and a zero among ordinary values."""
    x = _pairs(dtype, 3, 4)
    x[0, 0] = torch.tensor([float("inf"), 0.0])
    x[0, 1] = torch.tensor([1.0, -0.0])
    x[1, 1] = torch.tensor([float("nan"), 1.0])
    x[1, 2] = torch.tensor([0.0, float("-inf")])
    x[2, 3] = torch.tensor([0.0, 0.0])
    return x


def _mul_scalar(x, s):
    return R(torch.ops.aten.mul.Scalar(C(x), s))


def _mul_scalar_samples(dtype):
    out = []
    for s in (1j, 2.5 - 0.5j, 3.0, -2, 0.0, -0.0, complex(0, -0.0)):
        out.append(((_edge_pairs(dtype), s), {}))
    out.append(((_pairs(dtype, 0, 3), 1j), {}))
    return out


def _select(x, dim, index):
    return R(torch.select(C(x), dim, index))


def _unsqueeze(x, dim):
    return R(C(x).unsqueeze(dim))


def _dims_samples(dtype):
    x = _edge_pairs(dtype)
    return [((x, d, i), {}) for d, i in ((0, 1), (1, -1), (-1, 2), (-2, 0))]


def _unsqueeze_samples(dtype):
    x = _edge_pairs(dtype)
    return [((x, d), {}) for d in (0, 1, 2, -1, -2, -3)]


def _where(x, cond, y):
    return R(torch.where(cond, C(x), C(y)))


def _where_samples(dtype):
    g = torch.Generator().manual_seed(1)
    cond = torch.rand(3, 4, generator=g) > 0.5
    return [((_edge_pairs(dtype), cond, _pairs(dtype, 3, 4)), {}),
            ((_edge_pairs(dtype), cond, _pairs(dtype)), {}),  # a 0-d complex other
            ((_pairs(dtype, 4), cond, _pairs(dtype, 3, 1)), {})]  # broadcast


def _slice_write(x, src, dim):
    out = torch.zeros_like(C(x))
    if dim == -1:
        out[..., 1:3] = C(src)
    else:
        out[:2] = C(src)
    return R(out)


def _slice_write_samples(dtype):
    return [((_edge_pairs(dtype), _pairs(dtype, 3, 2), -1), {}),
            ((_edge_pairs(dtype), _pairs(dtype, 2, 4), 0), {})]


def _select_write(x, src, index):
    out = C(x).clone()
    out[:, index] = C(src)
    return R(out)


def _select_write_samples(dtype):
    return [((_edge_pairs(dtype), _pairs(dtype, 3), i), {}) for i in (0, -1)]


def _like(x, kind):
    c = C(x)
    if kind == "zeros":
        return R(torch.zeros_like(c))
    if kind == "ones":
        return R(torch.ones_like(c))
    if kind == "full":
        return R(torch.full_like(c, 2 - 1j))
    return torch.zeros_like(c, dtype=x.dtype) + 1  # a real result


def _like_samples(dtype):
    return [((_edge_pairs(dtype), k), {}) for k in ("zeros", "ones", "full", "real")]


def _convert(x, to):
    c = C(x)
    out = c.to(to)
    return R(out) if out.is_complex() else out


def _convert_samples(dtype):
    return [((_edge_pairs(dtype), to), {})
            for to in (torch.complex64, torch.complex128, torch.float32, torch.float64)]


def _made(x, kind):
    """Complex tensors made from real values or Python numbers, then mixed with ``x``."""
    c = C(x)
    if kind == "zeros":
        return R(c + torch.zeros(3, 4, dtype=c.dtype))
    if kind == "ones":
        return R(c * torch.ones(4, dtype=c.dtype))
    if kind == "full":
        return R(c * torch.full((4,), 2 - 1j, dtype=c.dtype))
    if kind == "scalar_tensor":
        return R(c * torch.scalar_tensor(-1j, dtype=c.dtype))
    if kind == "stack":
        return R(torch.stack([x[..., 0], c, c], dim=-1))
    return R(torch.cat([x[..., 1], c], dim=0))  # cat


def _made_samples(dtype):
    return [((_edge_pairs(dtype), k), {})
            for k in ("zeros", "ones", "full", "scalar_tensor", "stack", "cat")]


def _einsum(eq, *xs):
    return R(torch.einsum(eq, *[C(x) if x.shape[-1:] == (2,) else x for x in xs]))


def _einsum_samples(dtype):
    return [
        (("ij,jk->ik", _pairs(dtype, 3, 4), _pairs(dtype, 4, 5)), {}),
        (("bixy,ioxy->boxy", _pairs(dtype, 2, 3, 4, 4), _pairs(dtype, 3, 5, 4, 4)), {}),
        (("ij,jk,kl", _pairs(dtype, 2, 3), _pairs(dtype, 3, 4), _pairs(dtype, 4, 3)), {}),
        (("...i,...i->...", _pairs(dtype, 2, 3, 4), _pairs(dtype, 2, 3, 4)), {}),
        (("ij,jk->ik", _edge_pairs(dtype), _pairs(dtype, 4, 2)), {}),
    ]


def _roll(x, shifts, dims):
    return R(torch.roll(C(x), shifts, dims))


def _roll_samples(dtype):
    """Shifts past the length, negative ones, negative dims, the flattened roll (no dims), an
    empty tensor and a 0-d one."""
    x = _edge_pairs(dtype)
    out = [((x, s, d), {}) for s, d in ((1, 0), (-5, 1), (7, -1), ((1, -2), (0, 1)),
                                          ((2, 3), (-1, -2)), (3, ()), (-13, ()))]
    return out + [((_pairs(dtype, 0, 3), 2, 1), {}), ((_pairs(dtype), 1, ()), {})]


ENTRIES = [
    # real: OpInfo's samples (onnxmedic's translation also takes a symbolic shift:
    # tests/capture/test_backed_sizes.py); complex: the (real, imag) pair moves as one
    OpEntry("roll", dtypes=(torch.float32, torch.int64)),
    OpEntry("roll_complex", fn=_roll, dtypes=F32, use_opinfo=False, edge=_roll_samples),
    OpEntry("mul.Scalar", fn=_mul_scalar, dtypes=F32, use_opinfo=False, edge=_mul_scalar_samples),
    OpEntry("select.int", fn=_select, dtypes=F32, use_opinfo=False, edge=_dims_samples),
    OpEntry("unsqueeze", fn=_unsqueeze, dtypes=F32, use_opinfo=False, edge=_unsqueeze_samples),
    OpEntry("where.self", fn=_where, dtypes=F32, use_opinfo=False, edge=_where_samples),
    OpEntry("slice_scatter", fn=_slice_write, dtypes=F32, use_opinfo=False,
            edge=_slice_write_samples),
    OpEntry("select_scatter", fn=_select_write, dtypes=F32, use_opinfo=False,
            edge=_select_write_samples),
    OpEntry("zeros_like", fn=_like, dtypes=F32, use_opinfo=False, edge=_like_samples),
    OpEntry("_to_copy", fn=_convert, dtypes=F32, use_opinfo=False, edge=_convert_samples),
    OpEntry("made_complex", fn=_made, dtypes=F32, use_opinfo=False, edge=_made_samples),
    OpEntry("einsum", fn=_einsum, dtypes=F32, use_opinfo=False, edge=_einsum_samples),
]
make_tests(ENTRIES, globals())


class _Rotate(torch.nn.Module):
    """e3nn-style: a complex change of basis built in the graph, real in and out."""

    def forward(self, x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
        basis = torch.zeros(2, 2, dtype=torch.complex128)
        basis[0, 0] = 1
        basis[1, 1] = -1j
        phase = torch.stack([angle.cos(), angle.sin() * 1j, torch.ones_like(angle)], -1)
        rot = (basis.to(torch.complex64) * 1j).unsqueeze(0) * phase[:, :2, None]
        out = torch.einsum("bij,bj->bi", rot, x.to(torch.complex64))
        return torch.view_as_real(out).flatten(1)


class _Spectral(torch.nn.Module):
    """A Fourier-layer write of the low modes into a zero spectrum (slice_scatter on complex
    values with a parameter upstream: needs the decomposition without autograd)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 3, 2, 2, 2, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = torch.fft.rfft2(x)
        low = torch.einsum("bixy,ioxy->boxy", xf[:, :, :2, :2], torch.view_as_complex(self.w))
        out = torch.zeros_like(xf)
        out[:, :, :2, :2] = low
        return torch.fft.irfft2(out, s=x.shape[-2:])


def test_complex_rotation_exports_and_verifies():
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(4, 2, generator=g), torch.randn(4, generator=g))
    res = check_call(_Rotate().eval(), args)
    assert res.ok, res.error
    result = onnxmedic.export(_Rotate().eval(), args)
    assert result.ok, [(f.code, f.message) for f in result.findings]


def test_complex_slice_write_with_parameters_exports_and_verifies():
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    result = onnxmedic.export(_Spectral().eval(), (x,))
    assert result.ok, [(f.code, f.message) for f in result.findings]
    assert all(v.ok for v in result.verification)
