"""Indexing with a uint8 (byte) mask, captured as the bool mask it is.

PyTorch still treats a ``torch.uint8`` index tensor as a mask (``x[m]``, ``x[m] = v``,
``x.index_put_((m,), v)``: the elements where ``m`` is nonzero; deprecated, with a
UserWarning, since 1.2), as older code and PyTorch's own ONNX tests write it
(``input[torch.tensor([0, 1, 0], dtype=torch.uint8)]``). torch.export cannot capture it: the
fake-tensor rule of ``aten.index.Tensor`` accepts int8 where ATen accepts uint8 ("tensors used
as indices must be long, int, byte or bool tensors"), so every capture fails (OM111).

``byte_masks_as_bool`` converts each uint8 index tensor to bool (``m != 0``, the mask ATen
reads) where Python indexes, for the duration of a capture: the program holds a bool mask,
which torch.export captures with a data-dependent (unbacked) result size and the ONNX file
computes for any mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# calls whose index argument (args[1]) may hold a byte mask
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
             torch.Tensor.index_put, torch.index_put, torch.index_put_)


def _as_bool(index: Any) -> tuple[Any, bool]:
    """``index`` with each uint8 tensor in it (nested in tuples and lists) made bool, and
    whether there was one."""
    if isinstance(index, torch.Tensor):
        return (index.bool(), True) if index.dtype == torch.uint8 else (index, False)
    if isinstance(index, (tuple, list)):
        items = [_as_bool(i) for i in index]
        if any(changed for _, changed in items):
            return type(index)(i for i, _ in items), True
    return index, False


class _ByteMaskMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func in _INDEXING and len(args) >= 2:
            index, changed = _as_bool(args[1])
            if changed:
                args = (args[0], index, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def byte_masks_as_bool() -> Iterator[None]:
    """Within the block, a uint8 tensor used as an index is indexed with as a bool mask
    (see the module docstring)."""
    with _ByteMaskMode():
        yield
