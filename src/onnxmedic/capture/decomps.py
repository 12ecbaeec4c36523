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

from onnxmedic._torch_compat import patched_decompositions, rnn_loop_decompositions

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


# op -> the size-symbolic rule that replaces torch's decomposition while capturing
SYMBOLIC_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.affine_grid_generator.default: affine_grid_generator,
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
