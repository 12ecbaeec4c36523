"""``torch.equal`` as a guard torch.export can decide, for the duration of a capture.

``torch.equal(a, b)`` returns a Python bool computed from the values (``aten.equal``, tagged
``data_dependent_output``): under fake tensors torch raises ``DataDependentOutputException``
at once, in every capture - draft_export included, whose real-tensor propagation covers
guards on data-dependent *symbols* but not ops whose output is a Python value. Libraries use
it for fast paths (gpytorch's kernels: ``x1_eq_x2 = torch.equal(x1, x2)`` zeroes the
diagonal of a distance matrix when the test points are the points themselves).

``equal_as_guard`` computes it, within the block, the way torch's own reference
decomposition does (``torch._refs.equal``): sizes compared, then ``bool((a == b).all())``.
The outcome is then an ordinary data-dependent guard: decided by torch where it follows from
the sizes, by known values where they are constants (buffers, see capture.buffers), by the
example under draft_export (OM114, with verification on inputs meant to take the other
branch), and otherwise failing with the precise line as every other data-dependent branch
does. Each call whose outcome needed the values is recorded (``EqualSite``) so the finding can
say what was assumed.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_EQUAL = (torch.equal, torch.Tensor.equal)


@dataclass(frozen=True)
class EqualSite:
    """A ``torch.equal`` whose outcome was read from the values during the capture."""

    file: str
    line: int
    code: str
    value: bool

    def __str__(self) -> str:
        return f"{self.file}:{self.line} (`{self.code}`) gave {self.value}"


def equal_decomposed(a: torch.Tensor, b: torch.Tensor) -> Any:
    """torch.equal(a, b) as torch._refs.equal computes it - the sizes, then the elements -
    without its same-dtype check (eager torch.equal compares across dtypes); returns the
    0-d bool tensor of the element test, or a Python bool when the sizes decide."""
    if a.dim() != b.dim():
        return False
    for x, y in zip(a.shape, b.shape):
        if x != y:
            return False
    if a.numel() == 0:
        return True
    return (a == b).all()


class _EqualMode(TorchFunctionMode):
    def __init__(self, sites: list[EqualSite]) -> None:
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func not in _EQUAL or kwargs or len(args) != 2 or not all(
                isinstance(a, torch.Tensor) for a in args):
            return func(*args, **kwargs)
        res = equal_decomposed(*args)
        if isinstance(res, bool):
            return res
        value = bool(res)  # the guard: decided, or GuardOnDataDependentSymNode from here
        _record(self.sites, value)
        return value


def _record(sites: list[EqualSite], value: bool) -> None:
    from onnxmedic.capture.validation import guarding_frame

    try:
        frame = guarding_frame(skip=(__file__.replace("\\", "/"),))
        if frame is None:
            return
        file, line = frame.f_code.co_filename, frame.f_lineno
        site = EqualSite(file, line, linecache.getline(file, line).strip(), value)
        if site not in sites:
            sites.append(site)
    except Exception:  # the record is for the finding: never fail the capture over it
        logger.debug("could not record a torch.equal site", exc_info=True)


@contextlib.contextmanager
def equal_as_guard(sites: list[EqualSite] | None = None) -> Iterator[list[EqualSite]]:
    """Within the block, ``torch.equal`` / ``Tensor.equal`` are computed from sizes and an
    element test whose ``bool()`` is a data-dependent guard (see the module docstring);
    yields the list that records each call decided from the values."""
    found = [] if sites is None else sites
    with _EqualMode(found):
        yield found
