"""Capture with validation off: library switches and check-only branches.

Probabilistic and scientific libraries check their arguments with Python control flow on tensor
values (``if not constraint.check(value).all(): raise ValueError``, ``assert diff.all() or
(~diff).all()``, a warning on negative variances); torch.export cannot trace such a guard, and
plain torch.onnx fails on it too. Such a branch only raises or warns: on every input on which
the eager model does not raise, its outcome is known without looking at the values. Two
recoveries, both active only for the capture and undone afterwards, whatever happens:

* **library switches** (``SWITCHES``): the validation switches a library documents are turned
  off (torch.distributions' default ``validate_args``; pyro's ``enable_validation``;
  gpytorch's ``settings.debug``; gpytorch's and linear_operator's ``settings.trace_mode``, which
  their docs name for tracing: it specialises ``psd_safe_cholesky``'s bounded jitter-retry loop
  to its first iteration, a plain Cholesky, and evaluates lazy kernels eagerly).
* **check-only branches** (``neutralised_checks``): a data-dependent guard whose statement is
  an ``assert`` or an ``if`` whose body only raises or warns (no ``else``) gets the value that
  does not raise. torch.export already does this for a plain ``assert x``; this adds ``assert a
  or b`` and ``if bad.any(): raise``. Where the polarity cannot be read from the source, the
  guard is left to fail as before.

The verification stage runs the eager model with the user's settings (validation on), so a
divergence still shows up as a mismatch.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Switch:
    """A library's documented validation switch: ``module`` must already be imported (the
    model uses it); ``read`` returns the current setting, ``off`` turns validation off and
    returns an undo callable."""

    module: str
    name: str
    why: str
    read: Callable[[], Any]
    off: Callable[[], Callable[[], None]]


def _torch_dist_read() -> Any:
    import torch

    return torch.distributions.Distribution._validate_args


def _torch_dist_off() -> Callable[[], None]:
    import torch

    old = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    return lambda: torch.distributions.Distribution.set_default_validate_args(old)


@contextlib.contextmanager
def _distributions_built(seen: list[bool]) -> Iterator[None]:
    """seen[0] becomes True when a torch.distributions.Distribution is built (so that the
    finding names the torch.distributions switch only for models that use it)."""
    import torch

    cls = torch.distributions.Distribution
    original = cls.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        seen[0] = True
        original(self, *a, **kw)

    cls.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__init__ = original  # type: ignore[method-assign]


def _pyro_read() -> Any:
    from pyro.distributions import util

    return util.is_validation_enabled()


def _pyro_off() -> Callable[[], None]:
    import torch
    from pyro.distributions import util

    old, old_torch = util.is_validation_enabled(), torch.distributions.Distribution._validate_args
    util.enable_validation(False)

    def undo() -> None:
        util.enable_validation(old)  # also sets torch's default: put torch's own one back
        torch.distributions.Distribution.set_default_validate_args(old_torch)
    return undo


def _flag_read(module: str, name: str) -> Callable[[], Any]:
    def read() -> Any:
        return getattr(sys.modules[module], name)._state
    return read


def _flag(module: str, name: str, value: bool) -> Callable[[], Callable[[], None]]:
    """A gpytorch/linear_operator ``_feature_flag`` context, entered now and left by undo."""
    def off() -> Callable[[], None]:
        ctx = getattr(sys.modules[module], name)(value)
        ctx.__enter__()
        return lambda: ctx.__exit__(None, None, None)
    return off


SWITCHES: list[Switch] = [
    Switch("torch.distributions", "torch.distributions validate_args=False",
           "argument and support checks (constraint.check(...).all()) raise on invalid "
           "values only", _torch_dist_read, _torch_dist_off),
    Switch("pyro.distributions", "pyro.enable_validation(False)",
           "pyro's distribution checks raise or warn on invalid values only",
           _pyro_read, _pyro_off),
    Switch("gpytorch.settings", "gpytorch.settings.debug(False)",
           "safety checks on the inputs (e.g. a warning when the test inputs equal the "
           "training data) only raise or warn",
           _flag_read("gpytorch.settings", "debug"),
           _flag("gpytorch.settings", "debug", False)),
    Switch("gpytorch.settings", "gpytorch.settings.trace_mode(True)",
           "gpytorch's documented mode for tracing: lazy kernels are evaluated eagerly",
           _flag_read("gpytorch.settings", "trace_mode"),
           _flag("gpytorch.settings", "trace_mode", True)),
    Switch("linear_operator.settings", "linear_operator.settings.trace_mode(True)",
           "psd_safe_cholesky's jitter-retry loop is specialised to its first iteration (a "
           "plain Cholesky; the retries only run on a matrix that is not positive definite)",
           _flag_read("linear_operator.settings", "trace_mode"),
           _flag("linear_operator.settings", "trace_mode", True)),
]


def applicable_switches() -> list[Switch]:
    """The switches of libraries the process has imported (nothing is imported here)."""
    return [s for s in SWITCHES if s.module in sys.modules]


@dataclass
class Neutralised:
    """What a validation-off capture changed: switches turned off, check-only guards decided,
    and ``if torch.any(m):`` guards whose body only writes through ``m`` taken (capture.masked:
    the same values for every input, see OM117)."""

    switches: list[str] = field(default_factory=list)
    checks: list[tuple[str, int, str]] = field(default_factory=list)  # file, line, code
    masked: list[Any] = field(default_factory=list)  # capture.masked.MaskedSite


@contextlib.contextmanager
def validation_off(record: Neutralised) -> Iterator[None]:
    """Library switches off and check-only guards decided, for the duration of a capture;
    everything is restored on the way out, also when the capture raises."""
    undo: list[Callable[[], None]] = []
    built = [False]
    try:
        for s in applicable_switches():
            try:
                undo.append(s.off())
                record.switches.append(s.name)
            except Exception as e:  # a library version without that switch
                logger.debug("switch %s not applied: %s", s.name, e)
        with _decide_check_guards(record), _distributions_built(built):
            yield
    finally:
        if not built[0] and SWITCHES[0].name in record.switches:
            record.switches.remove(SWITCHES[0].name)  # torch is always imported: say it only
            # when the model built a distribution
        for u in reversed(undo):
            try:
                u()
            except Exception as e:
                logger.warning("could not restore a library setting: %s", e)


@contextlib.contextmanager
def _decide_check_guards(record: Neutralised) -> Iterator[None]:
    from onnxmedic._torch_compat import data_dependent_guards_decided
    from onnxmedic.capture.masked import masked_write_value

    def decide() -> bool | None:
        frame = guarding_frame()
        decided = check_only_value(frame) if frame is not None else None
        if decided is None:
            site = masked_write_value(frame) if frame is not None else None
            if site is None:
                return None
            if site not in record.masked:
                record.masked.append(site)
            return True
        value, where = decided
        if where not in record.checks:
            record.checks.append(where)
        return value

    with data_dependent_guards_decided(decide):
        yield


TRACER_FILES = ("/torch/fx/", "/torch/_export/", "/torch/export/", "/torch/_subclasses/",
                 "/torch/_dynamo/", "/torch/_functorch/", "/torch/overrides.py",
                 "/torch/_tensor.py", "/torch/utils/_", "/torch/_ops.py", "/torch/_prims",
                 "/torch/_refs/", "/torch/_decomp/", "/torch/_library/", "/torch/_higher_order",
                 "/torch/__init__.py", "/torch/_compile.py")


# capture/equal.py's and capture/byte_masks.py's torch-function modes sit between every call of
# the model and torch; _torch_compat's hooks sit between torch's guard and this module's
# decision
_OWN_FILES = ("/onnxmedic/capture/equal.py", "/onnxmedic/capture/byte_masks.py",
              "/onnxmedic/_torch_compat.py")


def guarding_frame(skip: tuple[str, ...] = ()) -> Any:
    """The frame of the code (user or library) whose bool() hit the guard: the first frame
    outside torch's tracing machinery, this module and the files in ``skip``."""
    import inspect

    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if name != __file__ and name not in skip and not name.startswith("<") and \
                not name.endswith(_OWN_FILES) and not any(t in name for t in TRACER_FILES):
            return frame
        frame = frame.f_back
    return None


_WARNERS = ("warn", "warning", "warn_once", "warn_if", "debug", "info")


def _only_raises_or_warns(body: list[ast.stmt]) -> bool:
    for st in body:
        if isinstance(st, (ast.Raise, ast.Pass)):
            continue
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            f = st.value.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in _WARNERS:
                continue
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
            continue  # a docstring-like string
        return False
    return bool(body)


def _polarity(test: ast.expr) -> bool | None:
    """True when every term of a test built with and/or appears un-negated, False when every
    one appears under ``not``, None when mixed (the term being evaluated is unknown)."""
    signs: set[bool] = set()

    def walk(e: ast.expr, neg: bool) -> None:
        if isinstance(e, ast.BoolOp):
            for v in e.values:
                walk(v, neg)
        elif isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            walk(e.operand, not neg)
        else:
            signs.add(neg)

    walk(test, False)
    return None if len(signs) != 1 else not signs.pop()


def _statement_at(filename: str, lineno: int) -> ast.stmt | None:
    """The innermost assert/if statement whose test spans ``lineno``."""
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assert, ast.If)):
            t = node.test
            if t.lineno <= lineno <= (t.end_lineno or t.lineno):
                if best is None or node.lineno >= best.lineno:
                    best = node
    return best


def check_only_value(frame: Any) -> tuple[bool, tuple[str, int, str]] | None:
    """For a guard evaluated in ``frame``: (the value under which the code does not raise,
    (file, line, code)) when the guard belongs to an ``assert`` or to an ``if`` whose body only
    raises or warns; None otherwise."""
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    st = _statement_at(filename, lineno)
    if st is None:
        return None
    pol = _polarity(st.test)
    if pol is None:
        return None
    code = linecache.getline(filename, st.lineno).strip()
    if isinstance(st, ast.Assert):
        # each term on the way to a passing assert is true (or, under `not`, false)
        return pol, (filename, st.lineno, code)
    if isinstance(st, ast.If) and not st.orelse and _only_raises_or_warns(st.body):
        # the branch is not taken: each term is false (or, under `not`, true)
        return (not pol), (filename, st.lineno, code)
    return None
