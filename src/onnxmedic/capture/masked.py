"""A guard ``if torch.any(m):`` whose body only writes through the mask, decided as taken.

Libraries compute a function on the selected elements of a tensor and write the results back
through the same boolean mask, skipping the work when nothing is selected (nflows' splines:
``if torch.any(inside_interval_mask): outputs[inside_interval_mask], logabsdet[...] =
spline(inputs[inside_interval_mask], ...)``). torch.export cannot trace the ``if``: whether any
element is selected depends on the values.

Taking the branch for every input computes the same values, whenever the body can do nothing
but write through the mask: with ``m`` all False, ``t[m] = v`` writes no element, so the body
changes nothing and skipping it is the same as running it. ``masked_write_value`` decides the
guard True only for an ``if`` (no ``else``) whose test is ``torch.any(m)`` or ``m.any()`` of a
bool tensor ``m`` and whose body is made of assignments alone, every target ``t[m]`` (or
``t[m, :]``, ``t[m, ...]``) of a local tensor through the same mask, with values that read
every tensor through that mask as well (``x[m]``, ``w[m, :]``): the body sees only the
selected elements, so it cannot change anything else - a copy of no rows in, no rows written.
Anything else (an ``else``, a bare call, a name assigned, a tensor read whole, a module call,
a lambda) leaves the guard to fail as before. A function the body calls is given only the
selected elements and plain values; one that changes a tensor it reaches by itself (a global,
a closure) is not seen here - the probe that selects nothing would show it as a mismatch.

What stays to check is that the graph computes the body on zero selected rows without failing
where the eager model skipped it; verification runs the branch probes for that (zeros,
negated, scaled x100, and every third element scaled x100: none, all and some selected by a
mask on the values; OM117).
"""

from __future__ import annotations

import ast
import builtins
import linecache
import logging
import types
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaskedSite:
    """An ``if torch.any(m):`` decided as taken: where, the code, the mask's name."""

    file: str
    line: int
    code: str
    mask: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} (`{self.code}`)"


def _if_at(filename: str, lineno: int) -> ast.If | None:
    """The innermost ``if`` whose test spans ``lineno``."""
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source) if source else None
    except SyntaxError:
        return None
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.If) and node.test.lineno <= lineno <= (
                node.test.end_lineno or node.test.lineno) and (
                best is None or node.lineno >= best.lineno):
            best = node
    return best


def _lookup(frame: Any, name: str) -> tuple[bool, Any]:
    """(found, value) of ``name`` as the frame's code would read it."""
    for scope in (frame.f_locals, frame.f_globals, vars(builtins)):
        if name in scope:
            return True, scope[name]
    return False, None


def _any_mask(test: ast.expr, frame: Any) -> str | None:
    """The mask's name when ``test`` is ``torch.any(m)`` or ``m.any()`` (no other argument)
    with ``torch`` the torch module and ``m`` a bool tensor of the frame, else None."""
    if not isinstance(test, ast.Call) or test.keywords or not isinstance(test.func,
                                                                         ast.Attribute):
        return None
    f = test.func
    if f.attr != "any":
        return None
    if len(test.args) == 1 and isinstance(f.value, ast.Name):
        ok, mod = _lookup(frame, f.value.id)
        if not (ok and mod is torch):
            return None
        arg = test.args[0]
    elif not test.args:
        arg = f.value
    else:
        return None
    if not isinstance(arg, ast.Name):
        return None
    ok, m = _lookup(frame, arg.id)
    if not (ok and isinstance(m, torch.Tensor) and m.dtype == torch.bool):
        return None
    return arg.id


def _through_mask(node: ast.Subscript, mask: str) -> bool:
    """``t[m]``, ``t[m, :]``, ``t[m, ...]``: indexed by the mask, then whole dims only."""
    idx = node.slice
    parts = idx.elts if isinstance(idx, ast.Tuple) else [idx]
    if not parts or not (isinstance(parts[0], ast.Name) and parts[0].id == mask):
        return False
    return all(isinstance(p, ast.Slice) and p.lower is None and p.upper is None
               and p.step is None or isinstance(p, ast.Constant) and p.value is Ellipsis
               for p in parts[1:])


# values a name in the body may hold besides tensors read through the mask: they hold no
# tensor the body could change or read whole
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_CALLABLE = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)


def _value_reads_through(value: ast.expr, mask: str, frame: Any) -> bool:
    """Every tensor the expression reads is read through the mask (see the module
    docstring); names hold plain values, functions or modules."""
    masked: set[int] = set()
    for node in ast.walk(value):
        if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.ListComp, ast.SetComp,
                             ast.DictComp, ast.GeneratorExp, ast.Await, ast.Yield,
                             ast.YieldFrom)):
            return False
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and \
                _through_mask(node, mask):
            masked.add(id(node.value))
            masked.add(id(node.slice if not isinstance(node.slice, ast.Tuple)
                          else node.slice.elts[0]))
    for node in ast.walk(value):
        if not isinstance(node, ast.Name) or id(node) in masked:
            continue
        ok, v = _lookup(frame, node.id)
        if not ok:
            return False
        if isinstance(v, _PLAIN) or isinstance(v, tuple) and all(isinstance(x, _PLAIN)
                                                                 for x in v):
            continue
        if isinstance(v, _CALLABLE) and not isinstance(v, torch.Tensor):
            # a function called on what the body reads; not a bound method of a module or
            # tensor (those are Names of other types): its object is not reachable here
            if isinstance(v, types.ModuleType) and v is not torch and \
                    not v.__name__.startswith("torch."):
                return False
            continue
        return False
    return True


def _targets_through(target: ast.expr, mask: str, frame: Any) -> bool:
    if isinstance(target, (ast.Tuple, ast.List)):
        return bool(target.elts) and all(_targets_through(t, mask, frame)
                                         for t in target.elts)
    if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
            and _through_mask(target, mask)):
        return False
    ok, t = _lookup(frame, target.value.id)
    return ok and isinstance(t, torch.Tensor)


def _writes_only_through(body: list[ast.stmt], mask: str, frame: Any) -> bool:
    for st in body:
        if isinstance(st, ast.Assign):
            targets, value = st.targets, st.value
        elif isinstance(st, ast.AugAssign):  # t[m] += v: reads and writes the same rows
            targets, value = [st.target], st.value
        else:
            return False
        if not all(_targets_through(t, mask, frame) for t in targets) or \
                not _value_reads_through(value, mask, frame):
            return False
    return bool(body)


def masked_write_value(frame: Any) -> MaskedSite | None:
    """For a guard evaluated in ``frame``: the site when the guard is the test of an ``if``
    whose body only writes through the tested mask (decided True: see the module
    docstring), else None."""
    try:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        st = _if_at(filename, lineno)
        if st is None or st.orelse:
            return None
        mask = _any_mask(st.test, frame)
        if mask is None or not _writes_only_through(st.body, mask, frame):
            return None
        return MaskedSite(filename, st.lineno, linecache.getline(filename, st.lineno).strip(),
                          mask)
    except Exception:  # reading the source or the frame failed: leave the guard as it was
        logger.debug("could not read a masked-write guard", exc_info=True)
        return None
