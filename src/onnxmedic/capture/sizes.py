"""Sizes kept symbolic where code turns them into Python numbers.

Under dynamic shapes a size is a ``torch.SymInt``; code that makes a Python number of it fixes
the size to the example's (torch.export adds a guard ``Eq(s0 - 1, 31)`` and refuses the
declared dim, OM401) or, worse, bakes the example's value into the program without a guard:

* ``float(width - 1) / 2`` (kornia's ``_compute_tensor_center``) and ``int(n)`` (einx's
  ``tuple(int(x) for x in tensor.shape)``): Python's ``float()``/``int()`` must return a real
  number. TorchDynamo (strict capture) traces them as ``torch.sym_float``/``torch.sym_int``;
  the non-strict capture here does the same by giving the module whose line made the number
  its own ``float``/``int`` (``sizes_stay_symbolic``): the builtin for every other argument,
  ``torch.sym_float(n)`` resp. ``n`` itself for a symbolic size. ``isinstance(v, float)`` in
  that module still means the builtin (the names are classes with the builtin's instance
  check); a module that compares types by identity (``type(v) is int``) is left alone.
* ``torch.as_tensor(3 * length / 4)`` (julius' ResampleFrac) and ``torch.asarray``: torch
  turns the symbolic scalar into a constant tensor of its example value, with no guard (the
  ONNX model then computes the example's output length at every length). ``torch.tensor`` of
  the same data builds the tensor from the symbolic values (``scalar_tensor`` + ``stack``);
  ``symbolic_factories`` routes the two to it for data of Python and symbolic scalars (the same
  tensor: for such data ``as_tensor`` copies like ``tensor``).

Both compute the same numbers as the code does; a later use that does need a Python number
still guards (and the dim is reported as before). The export's verification runs every
declared dim at other sizes; ``Kept`` records the lines for the finding (OM127).
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

SYM = (torch.SymInt, torch.SymFloat)


@dataclass
class Kept:
    """Where a capture kept a size symbolic: (file, line, code, what was kept)."""

    lines: list[tuple[str, int, str, str]] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # modules given symbolic int()/float()

    def note(self, what: str) -> None:
        from onnxmedic.capture.validation import guarding_frame

        try:
            frame = guarding_frame(skip=(__file__.replace("\\", "/"),))
            if frame is None:
                return
            file, line = frame.f_code.co_filename, frame.f_lineno
            entry = (file, line, linecache.getline(file, line).strip(), what)
            if entry not in self.lines:
                self.lines.append(entry)
        except Exception:  # the record is for the finding: never fail the capture over it
            logger.debug("could not record a kept size", exc_info=True)


def _leaves(data: Any) -> list[Any] | None:
    """The scalars of a (nested) list/tuple of Python and symbolic scalars, or None when
    ``data`` holds anything else (tensors, arrays)."""
    if isinstance(data, (list, tuple)):
        out: list[Any] = []
        for d in data:
            sub = _leaves(d)
            if sub is None:
                return None
            out += sub
        return out
    if isinstance(data, (bool, int, float, complex, *SYM)):
        return [data]
    return None


def _has_symbolic(data: Any) -> bool:
    leaves = _leaves(data)
    return leaves is not None and any(isinstance(v, SYM) for v in leaves)


def linspace_symbolic(start: Any, end: Any, steps: Any, dtype: torch.dtype, device: Any
                       ) -> torch.Tensor:
    """``torch.linspace(start, end, steps)`` for a symbolic ``steps`` (or endpoints) by the
    formula of torch's kernel: ``step = (end - start) / (steps - 1)`` in ``dtype``, the first
    half ``start + step * i``, the second ``end - step * (steps - 1 - i)`` (so both ends are
    exact), ``[start]`` for one step; no branch on ``steps``. torch's vectorised kernel adds
    the step within a vector instead, so a value may differ from eager's in the last bit."""
    idx = torch.arange(steps, dtype=dtype, device=device)
    s = torch.scalar_tensor(start, dtype=dtype, device=device)
    e = torch.scalar_tensor(end, dtype=dtype, device=device)
    last = torch.scalar_tensor(steps - 1, dtype=dtype, device=device)
    step = (e - s) / torch.scalar_tensor(torch.sym_max(steps - 1, 1), dtype=dtype,
                                         device=device)
    # steps == 1: halfway 1, so the one value is start
    return torch.where(idx < torch.sym_max(steps // 2, 1), s + step * idx,
                       e - step * (last - idx))


@contextlib.contextmanager
def symbolic_factories(record: Kept, active: bool = True) -> Iterator[None]:
    """While active, ``torch.as_tensor``/``torch.asarray`` of Python and symbolic scalars are
    ``torch.tensor`` of them (which keeps symbolic values symbolic), and ``torch.linspace``
    with a symbolic number of steps (its schema takes an ``int``, so torch fixes it) or
    symbolic endpoints is computed from them (``linspace_symbolic``); restored on exit."""
    if not active:
        yield
        return
    as_tensor, asarray, linspace = torch.as_tensor, torch.asarray, torch.linspace

    def linspace_(start: Any, end: Any, steps: Any, *, out: Any = None, dtype: Any = None,
                  layout: Any = torch.strided, device: Any = None, pin_memory: bool = False,
                  requires_grad: bool = False) -> torch.Tensor:
        dt = dtype or torch.get_default_dtype()
        if any(isinstance(v, SYM) for v in (start, end, steps)) and out is None \
                and layout == torch.strided and not pin_memory and dt.is_floating_point \
                and all(isinstance(v, (int, float, *SYM)) for v in (start, end, steps)):
            record.note("torch.linspace over a size computed from the symbolic size")
            return linspace_symbolic(start, end, steps, dt, device).requires_grad_(
                requires_grad)
        return linspace(start, end, steps, out=out, dtype=dtype, layout=layout, device=device,
                        pin_memory=pin_memory, requires_grad=requires_grad)

    def as_tensor_(data: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
        if _has_symbolic(data):
            record.note("torch.as_tensor of a size built from the symbolic value")
            return torch.tensor(data, dtype=dtype, device=device)
        return as_tensor(data, dtype=dtype, device=device)

    def asarray_(obj: Any, *, dtype: Any = None, device: Any = None, copy: Any = None,
                 requires_grad: bool = False) -> torch.Tensor:
        if _has_symbolic(obj) and copy is not False:
            record.note("torch.asarray of a size built from the symbolic value")
            return torch.tensor(obj, dtype=dtype, device=device, requires_grad=requires_grad)
        return asarray(obj, dtype=dtype, device=device, copy=copy, requires_grad=requires_grad)

    torch.as_tensor, torch.asarray, torch.linspace = as_tensor_, asarray_, linspace_
    try:
        yield
    finally:
        torch.as_tensor, torch.asarray, torch.linspace = as_tensor, asarray, linspace


class _BuiltinCheck(type):
    """``isinstance``/``issubclass`` against the builtin a shadowing class stands for."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._builtin)  # type: ignore[attr-defined]

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, cls._builtin)  # type: ignore[attr-defined]


def _shadow(builtin: type, convert: Any, record: Kept) -> type:
    """A class named like ``builtin`` whose call gives ``convert(v)`` for a symbolic scalar
    ``v`` and the builtin's result for everything else."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        if len(args) == 1 and not kwargs and isinstance(args[0], SYM):
            record.note(f"{builtin.__name__}() of a size kept symbolic")
            return convert(args[0])
        return builtin(*args, **kwargs)

    return _BuiltinCheck(builtin.__name__, (builtin,), {
        "__new__": __new__, "_builtin": builtin, "__module__": "builtins",
        "__qualname__": builtin.__qualname__})


def _symbolic_int(v: Any) -> Any:
    return v if isinstance(v, torch.SymInt) else torch.sym_int(v)


SHADOWED = {"float": (builtins.float, torch.sym_float), "int": (builtins.int, _symbolic_int)}


def compares_types(source: str, name: str) -> bool:
    """Whether module source compares with ``name`` by identity, equality or membership
    (``type(v) is int``, ``t == float``, ``type(v) in (int, bool)``), which a shadowing class
    would answer differently. Source that does not parse counts as comparing."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return True

    def names(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id == name
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names(e) for e in node.elts)
        return False

    kinds = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq, ast.In, ast.NotIn)
    return any(isinstance(n, ast.Compare) and any(isinstance(op, kinds) for op in n.ops)
               and any(names(e) for e in (n.left, *n.comparators)) for n in ast.walk(tree))


@contextlib.contextmanager
def sizes_stay_symbolic(modules: list[str], record: Kept) -> Iterator[None]:
    """While active, each named module's ``float``/``int`` keep a symbolic size symbolic (see
    the module docstring); the modules' globals are restored on exit."""
    missing = object()
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for name in modules:
            mod = sys.modules.get(name)
            if mod is None:
                continue
            try:
                source = open(mod.__file__, encoding="utf-8").read()  # noqa: SIM115
            except (OSError, TypeError):
                continue
            for shadowed, (builtin, convert) in SHADOWED.items():
                if compares_types(source, shadowed) or shadowed in vars(mod) and \
                        vars(mod)[shadowed] is not builtin:
                    continue
                saved.append((vars(mod), shadowed, vars(mod).get(shadowed, missing)))
                vars(mod)[shadowed] = _shadow(builtin, convert, record)
            if name not in record.modules:
                record.modules.append(name)
        yield
    finally:
        for namespace, shadowed, old in reversed(saved):
            if old is missing:
                namespace.pop(shadowed, None)
            else:
                namespace[shadowed] = old


# the conversions a specialising line calls on a size (torch/__init__.py's SymInt/SymFloat)
_CONVERSIONS = ("__int__", "__index__", "__float__", "__trunc__")
_CALLS = re.compile(r"\b(int|float)\s*\(")


def module_of(filename: str) -> str | None:
    """The name of the imported module whose file is ``filename``."""
    target = os.path.realpath(filename)
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and os.path.realpath(f) == target:
            return name
    return None


def converting_modules(specialised: dict[str, tuple[str, list[Any]]],
                       internal: Any) -> list[str]:
    """Modules whose line fixed a declared dim by calling ``int()``/``float()`` on it: the
    innermost frame outside torch (``internal(filename)`` is False) of each specialisation's
    stack, when the frame it called is a SymInt/SymFloat conversion and the line calls
    ``int(``/``float(``."""
    found: list[str] = []
    for _guard, stack in specialised.values():
        outside = [i for i, f in enumerate(stack) if not internal(f.filename)]
        if not outside or outside[-1] + 1 >= len(stack):
            continue
        at, callee = stack[outside[-1]], stack[outside[-1] + 1]
        if callee.name not in _CONVERSIONS or not callee.filename.replace(
                "\\", "/").endswith("/torch/__init__.py"):
            continue
        if not _CALLS.search(at.line or linecache.getline(at.filename, at.lineno)):
            continue
        name = module_of(at.filename)
        if name is not None and name not in found:
            found.append(name)
    return found
