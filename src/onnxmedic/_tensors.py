"""Conversions between torch tensors, numpy arrays and nested Python structures."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree


def to_numpy(t: Any) -> np.ndarray:
    """A torch tensor (any dtype ONNX Runtime knows, bfloat16 included) as a numpy array."""
    if isinstance(t, np.ndarray):
        return t
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    if t.is_conj():
        t = t.resolve_conj()
    return t.contiguous().numpy()


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested output, in pytree order (the order torch.onnx uses)."""
    leaves = pytree.tree_leaves(obj)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif isinstance(leaf, (int, float, bool)) and not isinstance(leaf, torch.SymInt):
            out.append(torch.tensor(leaf))
    return out


def describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')}[{'x'.join(map(str, t.shape)) or 'scalar'}]"
    return type(t).__name__


@contextlib.contextmanager
def reference_mode() -> Iterator[None]:
    """How PyTorch's reference outputs are computed: without autograd, and with the fused
    inference fast path of nn.MultiheadAttention / nn.TransformerEncoderLayer off.

    torch.export captures the modules' ordinary path (the fast path only runs where no gradient
    is needed), so the reference computes what the ONNX model was made from. The two paths
    agree to float32 rounding, except on a query row whose keys are all masked: the fast path
    returns NaN there, scaled_dot_product_attention (the ordinary path) 0."""
    fastpath = getattr(torch.backends, "mha", None)
    before = fastpath.get_fastpath_enabled() if fastpath is not None else None
    try:
        if fastpath is not None:
            fastpath.set_fastpath_enabled(False)
        with torch.no_grad():
            yield
    finally:
        if fastpath is not None:
            fastpath.set_fastpath_enabled(before)


def tensor_bytes(model: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of the model's parameters and buffers, each tensor once (tied weights too), with
    the floating ones converted to ``dtype`` when given (what a converted copy would hold)."""
    size = torch.tensor([], dtype=dtype).element_size() if dtype is not None else None
    seen = {id(t): t.numel() * (size if size is not None and t.is_floating_point()
                                else t.element_size())
            for t in list(model.parameters()) + list(model.buffers())}
    return sum(seen.values())


def tensor_like(t: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A new tensor of ``shape`` with values in ``t``'s range and ``t``'s dtype."""
    if t.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    flat = t.reshape(-1)
    if t.dtype.is_floating_point:
        finite = flat[torch.isfinite(flat)].double()
        lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(t.dtype)
    if t.is_complex() or flat.numel() == 0:
        return torch.zeros(shape, dtype=t.dtype)
    lo, hi = int(flat.min()), int(flat.max())
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(t.dtype)
