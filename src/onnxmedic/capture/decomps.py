"""Shape rules that keep declared-dynamic sizes symbolic where torch's own fix them.

Tracing computes every op's output on fake tensors; for ops without a symbolic meta kernel
FakeTensorMode runs torch's Python decomposition, and a few of those turn a size into a
constant: ``aten.affine_grid_generator`` calls ``torch.linspace(-a, a, steps=w)`` with
``a = (w - 1) / w``, a symbolic *float* endpoint that torch.export can only specialise
(``Eq(w, 28)``, ``_decomp/decompositions.py`` in ``_linspace_from_neg_one``), and the RNN
decompositions loop over the time steps in Python. ``symbolic_shape_rules`` replaces them,
scoped, while a program with dynamic shapes is captured and decomposed for translation. Each
replacement computes the same values as torch's (the export's verification compares them at
other sizes of each dynamic dim).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from onnxmedic._torch_compat import (
    patched_decompositions,
    rnn_loop_decompositions,
    torch_decomposition,
)

aten = torch.ops.aten


def _grid_axis(n: Any, align_corners: bool, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """``torch.linspace(-a, a, n)`` of the affine grid (``a = 1`` with align_corners, else
    ``(n - 1) / n``; ``[0]`` for ``n == 1``) as integer arithmetic over a symbolic n:
    ``(2 i - (n - 1)) / max(n - 1, 1)``, resp. ``(2 i + 1 - n) / n`` - no float endpoints,
    no branch on n."""
    i = torch.arange(n, device=device, dtype=dtype)
    if align_corners:
        return (i * 2 - (n - 1)) / torch.sym_max(n - 1, 1)
    return (i * 2 + (1 - n)) / n


def _base_grid(theta: torch.Tensor, sizes: list[Any], align_corners: bool) -> torch.Tensor:
    """(*sizes, k + 1): x, y[, z], 1 per point, as torch's _make_base_grid_4d/5d."""
    k = len(sizes)
    axes = [_grid_axis(s, align_corners, theta.dtype, theta.device) for s in sizes]
    parts = []
    for j, ax in enumerate(reversed(axes)):  # x (the last size) first
        shape = [1] * k + [1]
        shape[k - 1 - j] = -1
        parts.append(torch.nn.functional.pad(ax.view(shape), (j, k - j), value=0.0))
    one = torch.ones([1] * (k + 1), dtype=theta.dtype, device=theta.device)
    return sum(parts, torch.nn.functional.pad(one, (k, 0), value=0.0))


def affine_grid_generator(theta: torch.Tensor, size: list[Any], align_corners: bool
                          ) -> torch.Tensor:
    """aten.affine_grid_generator(Tensor theta, SymInt[] size, bool align_corners) as torch's
    decomposition computes it, with the grid axes of ``_grid_axis``."""
    torch._check(len(size) in (4, 5),
                 lambda: "affine_grid_generator needs 4d (spatial) or 5d (volumetric) inputs.")
    dtype = theta.dtype
    if dtype in (torch.float16, torch.bfloat16):  # torch's pw_cast_for_opmath
        theta = theta.float()
    n, spatial = size[0], list(size[2:])
    k = len(spatial)
    base = _base_grid(theta, spatial, align_corners)  # (*spatial, k + 1)
    grid = (base.view(-1, k + 1, 1) * theta.mT.unsqueeze(1)).sum(-2)
    return grid.view(n, *spatial, k).to(dtype)


def _adaptive_window_means(x: torch.Tensor, dim: int, out: int) -> torch.Tensor:
    """Means of x over PyTorch's adaptive windows along ``dim`` (negative) of a symbolic size
    n: window o is [floor(o n / out), ceil((o + 1) n / out)), at most ``n // out + 2`` long for
    every n, so a fixed (out, n // out + 2) gather with a validity mask covers all of them
    without a branch on n. The result has out in place of n."""
    n = x.shape[dim]
    q, r = n // out, n % out  # n = q out + r: the tensor divisions below stay below out**2
    o = torch.arange(out, device=x.device, dtype=torch.int64)
    start = o * q + torch.div(o * r, out, rounding_mode="floor")
    end = (o + 1) * q + torch.div((o + 1) * r + (out - 1), out, rounding_mode="floor")
    idx = start.unsqueeze(-1) + torch.arange(q + 2, device=x.device, dtype=torch.int64)
    valid = idx < end.unsqueeze(-1)
    idx = torch.minimum(idx, torch.scalar_tensor(n - 1, dtype=torch.int64, device=x.device))
    vals = x.index_select(dim, idx.flatten()).unflatten(dim, idx.shape)  # (..., out, K, ...)
    tail = [1] * (-dim - 1)
    # masked, not multiplied by a 0/1 weight: an inf or NaN reaches only its own windows
    vals = torch.where(valid.view(*valid.shape, *tail), vals,
                       torch.zeros((), dtype=x.dtype, device=x.device))
    # divided per axis, not by the window areas: ONNX's shape-data propagation mis-ranks the
    # int outer product of the two lengths (OM502)
    return vals.sum(dim) / (end - start).to(x.dtype).view(out, *tail)


def adaptive_avg_pool2d(x: torch.Tensor, output_size: list[int]) -> torch.Tensor:
    """aten._adaptive_avg_pool2d(Tensor self, SymInt[2] output_size): PyTorch's windows for any
    input size, one spatial axis at a time (means over the exact windows). With static spatial sizes torch's decomposition (avg_pool2d where the sizes
    divide)."""
    torch._check(x.dim() in (3, 4),
                 lambda: f"adaptive_avg_pool2d(): Expected 3D or 4D tensor, but got {x.dim()}")
    if all(isinstance(s, int) for s in x.shape[-2:]):
        return _TORCH_ADAPTIVE_AVG_POOL2D(x, output_size)
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):  # torch's pw_cast_for_opmath
        x = x.float()
    out_h, out_w = output_size
    return _adaptive_window_means(_adaptive_window_means(x, -1, out_w), -2, out_h).to(dtype)


# torch's own rule, kept for static spatial sizes (its avg_pool2d is the cheaper graph)
_TORCH_ADAPTIVE_AVG_POOL2D = torch_decomposition(aten._adaptive_avg_pool2d.default)


# op -> the size-symbolic rule that replaces torch's decomposition while capturing
SYMBOLIC_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.affine_grid_generator.default: affine_grid_generator,
    aten._adaptive_avg_pool2d.default: adaptive_avg_pool2d,
}


@contextlib.contextmanager
def symbolic_shape_rules(active: bool = True) -> Iterator[None]:
    """While active: ``SYMBOLIC_DECOMPOSITIONS`` in torch's decomposition table, torch's
    while_loop rules for LSTM/GRU, and torch.einsum without opt_einsum (its contract_path
    turns every size into a Python int, ``opt_einsum/contract.py: dim = int(sh[cnum])``; the
    contraction is the same, left to right); torch is restored on exit."""
    if not active:
        yield
        return
    with rnn_loop_decompositions(), patched_decompositions(SYMBOLIC_DECOMPOSITIONS), \
            torch.backends.opt_einsum.flags(enabled=False):
        yield
