"""Capture with the values that depend on no input known: Python control flow that reads a
buffer, a parameter, or a tensor the model makes from constants.

torch.export treats every buffer and parameter as an input of unknown value, and traces a
tensor made in forward (``torch.linspace(0, 1, n)``) with a fake tensor of unknown value too,
so ``if not self.updated_strategy.item()`` (gpytorch's variational strategy), ``if t[0] > t[1]``
on a time grid kept as a buffer (torchdiffeq) or built in forward (torchcde's splines), the
fixed-step count ``torch.ceil((t1 - t0) / h).item()`` read from it, or ``if not
self.data_dep_init_done > 0`` (normflows' ActNorm) cannot be decided and the capture fails. In
the ONNX file buffers and parameters are constants (initializers), and a tensor computed from
them, constants and static sizes alone is the same on every call, so the exported function may
take the branch their values select.

How: torch's real-tensor propagation (the machinery of draft_export), restricted to values that
do not depend on the inputs. The fake tensors of the model's buffers and parameters carry their
real values; an op is also run on the real values when its result is the same on every input
(``_from_constants``): its tensor arguments all carry real values, no argument is sized by an
input (no backed symbol), it draws no random numbers, no op with an input has written into the
memory it reads (a view taken before ``t.add_(x)``), and it writes none of the model's own
tensors. Everything else stays fake, as in a plain capture, and its outputs lose any real value.
A factory (``linspace``, ``arange``, ``zeros``) has no tensor argument, so its result carries a
value. A guard on a data-dependent value is then decided exactly when the value is a function
of buffers, parameters, constants and static sizes alone; a guard that involves an input still
fails as before. Reading a number from such a value (``.item()``, ``bool()``) gives a Python
number, so the branch leaves no trace in the program: the value is read like a Python
attribute, and the program keeps no unbacked symbol that a later pass (decompositions) could
not decide again. Each real value remembers the buffers and parameters it was computed from, so
the findings can tell a guard on a buffer (OM116) from one on values made from constants or
parameters (OM119). Buffers and parameters are copied up to ``CLONE_LIMIT`` bytes in all;
beyond that the model's own tensors carry the values, and an op that writes one is not run on
the values (its result is then unknown).
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from onnxmedic._torch_compat import (
    fake_dispatch_replaced,
    fake_tensor_type,
    fakify_params_replaced,
    real_mode,
    real_tensor_decisions_logged,
)

logger = logging.getLogger(__name__)

CLONE_LIMIT = 64 * 2**20


@dataclass
class Decided:
    """What a buffer-valued capture decided: the guards and the buffers they read."""

    # guards on values a buffer went into (OM116): (file, line, code, what: "reads True",
    # "Eq(u0, 1) is False")
    guards: list[tuple[str, int, str, str]] = field(default_factory=list)
    buffers: dict[str, str] = field(default_factory=dict)  # qualified name -> value shown
    # guards on values no buffer went into (OM119): made in forward from constants and static
    # sizes (a time grid built by torch.linspace), or read from parameters
    constant: list[tuple[str, int, str, str]] = field(default_factory=list)
    parameters: dict[str, str] = field(default_factory=dict)  # qualified name -> value shown


def show_value(t: torch.Tensor) -> str:
    """A buffer's value for a finding: the number, a short list, or dtype and shape."""
    if t.device.type == "meta":
        return f"{t.dtype} {tuple(t.shape)}"
    if t.dim() == 0:
        return repr(t.item())
    if t.numel() <= 8:
        return repr(t.tolist())
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def real_value(buf: torch.Tensor, clone: bool) -> torch.Tensor:
    """The value a buffer's fake tensor carries: a copy, or the buffer itself when large."""
    return buf.detach().clone() if clone else buf.detach()


def _storage(t: torch.Tensor) -> int:
    """The real tensor's storage, as a key (0 for a tensor without memory)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


@dataclass
class _Values:
    """The real values of a constant-propagating capture: where each came from, and which
    memory may no longer be read as constant."""

    # id(real tensor) -> (the tensor, kept alive so the id stays its own; the buffers and
    # parameters it was computed from, as ("buffer" | "parameter", qualified name))
    origin: dict[int, tuple[torch.Tensor, frozenset[tuple[str, str]]]] = field(
        default_factory=dict)
    # storages written by an op that is not from constants (an input went in): every view of
    # them, made before the write, has a stale value
    poisoned: set[int] = field(default_factory=set)
    # storages of the model's own tensors (not copies): never written for real
    shared: set[int] = field(default_factory=set)

    def sources(self, flat: list[Any]) -> frozenset[tuple[str, str]]:
        FakeTensor = fake_tensor_type()  # noqa: N806 - a class

        found: frozenset[tuple[str, str]] = frozenset()
        for a in flat:
            if isinstance(a, FakeTensor) and a.real_tensor is not None:
                entry = self.origin.get(id(a.real_tensor))
                if entry is not None:
                    found |= entry[1]
        return found

    def mark(self, out: Any, names: frozenset[tuple[str, str]]) -> None:
        import torch.utils._pytree as pytree
        FakeTensor = fake_tensor_type()  # noqa: N806 - a class

        if not names:
            return
        for t in pytree.tree_leaves(out):
            if isinstance(t, FakeTensor) and t.real_tensor is not None:
                r = t.real_tensor
                old = self.origin.get(id(r))
                self.origin[id(r)] = (r, names | (old[1] if old is not None else frozenset()))


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The fake tensors an op writes (in place, ``out=``)."""
    import torch.utils._pytree as pytree
    FakeTensor = fake_tensor_type()  # noqa: N806 - a class

    from onnxmedic._torch_compat import written_arguments

    return [t for t in pytree.tree_leaves(written_arguments(func, args, kwargs))
            if isinstance(t, FakeTensor)]


def _from_constants(func: Any, args: Any, kwargs: Any, flat: list[Any], backed: Any,
                    values: _Values) -> bool:
    """True when an op's result is the same on every input: every tensor argument carries a
    real value that no op with an input has written since, nothing is sized by an input (no
    backed symbol; an unbacked one has a known value or torch does not propagate), the op
    draws no random numbers, and it writes none of the model's own tensors (copies only)."""
    FakeTensor = fake_tensor_type()  # noqa: N806 - a class

    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return False
    for a in flat:
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if a.node.expr.free_symbols & backed:
                return False
        elif isinstance(a, FakeTensor):
            if a.real_tensor is None or any(
                    isinstance(s, torch.SymInt) and s.node.expr.free_symbols & backed
                    for s in a.shape):
                return False
            if values.poisoned and _storage(a.real_tensor) in values.poisoned:
                return False
    if values.shared and any(t.real_tensor is not None and _storage(t.real_tensor)
                             in values.shared for t in _written(func, args, kwargs)):
        return False
    return True


def _forget_values(out: Any) -> None:
    """An op that is not from constants gives no real value: a decomposition may return a
    tensor a factory inside it made (``empty_strided``, real) and an op on an input filled;
    an in-place op on a constant with an input makes it depend on the input."""
    import torch.utils._pytree as pytree
    FakeTensor = fake_tensor_type()  # noqa: N806 - a class

    for t in pytree.tree_leaves(out):
        if isinstance(t, FakeTensor):
            t.real_tensor = None


def _held_constant(mode: Any, t: torch.Tensor, values: _Values) -> torch.Tensor:
    """A real tensor an op meets during the trace is one the model holds (a plain tensor
    attribute such as ``self.t = torch.linspace(...)``: the ONNX file keeps it as a constant),
    never an input (inputs are fake): its fake, as torch would make it, carries its value. It
    is the model's own tensor, so an op that writes it is not run on the value."""
    FakeTensor = fake_tensor_type()  # noqa: N806 - a class

    from onnxmedic._torch_compat import fake_of_real

    if isinstance(t, FakeTensor) or type(t) is not torch.Tensor or t.device.type == "meta":
        return t
    fake = fake_of_real(mode, t)
    if fake.real_tensor is None:
        fake.real_tensor = t.detach()
        key = _storage(t)
        if key:
            values.shared.add(key)
    return fake


@contextlib.contextmanager
def _constant_propagation(mode: Any, values: _Values,
                          on_read: Callable[[Any, frozenset[tuple[str, str]]], None]
                          ) -> Iterator[None]:
    """Real values only for ``mode``'s ops whose result is the same on every input
    (``_from_constants``: buffers, parameters, factories of constants and static sizes);
    reading a number from such a tensor (``.item()``, ``bool()``, ``int()``) gives that
    number - a Python constant, as if the code had read a Python attribute - and calls
    ``on_read`` with it and the buffers and parameters it was computed from."""
    import torch.utils._pytree as pytree
    FakeTensor = fake_tensor_type()  # noqa: N806 - a class

    scalar = torch.ops.aten._local_scalar_dense.default
    lifts = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

    original: Any = None

    def dispatch_impl(self: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if self is not mode:
            return original(self, func, types, args, kwargs)
        env = self.shape_env
        backed = set(env.backed_var_to_val) if env is not None else set()
        if func in lifts and type(args[0]) is torch.Tensor:
            # a tensor literal (torch.tensor(...)) entering the trace: torch makes its fake,
            # which carries the literal's value
            literal = args[0].detach().clone()
            self.propagate_real_tensors = False
            try:
                out = original(self, func, types, args, kwargs)
            finally:
                self.propagate_real_tensors = True
            if isinstance(out, FakeTensor) and literal.device.type != "meta":
                out.real_tensor = literal
            return out
        if any(type(a) is torch.Tensor for a in pytree.tree_leaves((args, kwargs))):
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: _held_constant(self, t, values), (args, kwargs))
        flat = pytree.tree_leaves((args, kwargs))
        if _from_constants(func, args, kwargs, flat, backed, values):
            names = values.sources(flat)
            if func is scalar and isinstance(args[0], FakeTensor) \
                    and args[0].real_tensor is not None:
                with real_mode():
                    value = args[0].real_tensor.item()
                on_read(value, names)
                return value
            out = original(self, func, types, args, kwargs)
            values.mark(out, names)
            return out
        for t in _written(func, args, kwargs):
            if t.real_tensor is not None:
                values.poisoned.add(_storage(t.real_tensor))
        values.poisoned.discard(0)
        self.propagate_real_tensors = False
        try:
            out = original(self, func, types, args, kwargs)
        finally:
            self.propagate_real_tensors = True
        _forget_values(out)
        return out

    def wrap(impl: Any) -> Any:
        nonlocal original
        original = impl
        return dispatch_impl

    # the program keeps this mode (its nodes' fake values): later passes (decompositions)
    # must see a plain one again
    cache = mode.cache_enabled
    mode.propagate_real_tensors, mode.cache_enabled = True, False
    try:
        with fake_dispatch_replaced(mode, wrap):
            yield
    finally:
        mode.propagate_real_tensors, mode.cache_enabled = False, cache


def _guard_site() -> tuple[str, int, str, Any] | None:
    from onnxmedic.capture.validation import guarding_frame

    frame = guarding_frame(skip=(__file__.replace("\\", "/"),))
    if frame is None:
        return None
    file, line = frame.f_code.co_filename, frame.f_lineno
    return file, line, linecache.getline(file, line).strip(), frame


def _tensors_read(frame: Any, code: str, real: dict[int, tuple[str, str]],
                  modules: dict[int, str]) -> list[tuple[str, str]]:
    """The buffers and parameters a guard read, where torch decided it from real values
    without an ``.item()`` onnxmedic saw: locals of the guarding frame (and its callers')
    backed by a buffer's or parameter's value, and ``self.<name>`` named in the guard's
    line."""
    FakeTensor = fake_tensor_type()  # noqa: N806 - a class

    found: list[tuple[str, str]] = []
    depth = 0
    while frame is not None and depth < 12:
        for name, value in frame.f_locals.items():
            if isinstance(value, FakeTensor) and id(value.real_tensor) in real:
                found.append(real[id(value.real_tensor)])
            elif name == "self" and id(value) in modules:
                prefix = modules[id(value)]
                for attr in re.findall(r"self\.(\w+)", code):
                    for kind, table in (("buffer", "_buffers"), ("parameter", "_parameters")):
                        if attr in getattr(value, table, {}):
                            found.append((kind, f"{prefix}.{attr}" if prefix else attr))
        if found:
            break
        frame, depth, code = frame.f_back, depth + 1, ""
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def buffers_known(model: torch.nn.Module, record: Decided) -> Iterator[None]:
    """Within the block, torch.export captures ``model`` with the values that depend on no
    input known (see the module docstring): its buffers', its parameters', and those of the
    tensors computed from them, from constants and from static sizes; ``record`` gets the
    guards decided and the buffers and parameters they read."""
    named = {"buffer": dict(model.named_buffers(remove_duplicate=False)),
             "parameter": dict(model.named_parameters(remove_duplicate=False))}
    shown = {kind: {n: show_value(t) for n, t in tensors.items()}  # now: not under fake mode
             for kind, tensors in named.items()}
    modules = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    real: dict[int, tuple[str, str]] = {}  # id(real tensor given to a fake) -> its tensor
    values = _Values()
    original_fakify: Any = None
    stack = contextlib.ExitStack()

    def fakify(fake_mode: Any, mod: torch.nn.Module) -> dict[str, Any]:
        fakes = original_fakify(fake_mode, mod)
        if mod is not model:
            return fakes
        budget, copies = CLONE_LIMIT, {}
        for kind, tensors in named.items():
            for name, t in tensors.items():
                fake = fakes.get(name)
                if fake is None or t.device.type == "meta" or fake.real_tensor is not None:
                    continue
                if id(t) not in copies:  # tied weights: one value
                    size = t.numel() * t.element_size()
                    copies[id(t)] = real_value(t, clone=size <= budget)
                    if size <= budget:
                        budget -= size
                    else:
                        values.shared.add(_storage(copies[id(t)]))
                value = copies[id(t)]
                fake.real_tensor = value
                real.setdefault(id(value), (kind, name))
                old = values.origin.get(id(value), (value, frozenset()))[1]
                values.origin[id(value)] = (value, old | {(kind, name)})
        values.shared.discard(0)
        stack.enter_context(_constant_propagation(
            fake_mode, values, lambda value, names: note(f"reads {value!r}", names)))
        return fakes

    def note(what: str, names: frozenset[tuple[str, str]] | None = None) -> None:
        try:
            site = _guard_site()
            if site is None:
                return
            file, line, code, frame = site
            read = sorted(names) if names is not None else _tensors_read(
                frame, code, real, modules)
            by_buffer = any(kind == "buffer" for kind, _ in read)
            for kind, name in read:
                if kind == "buffer" or not by_buffer:
                    (record.buffers if kind == "buffer" else record.parameters).setdefault(
                        name, shown[kind][name])
            guards = record.guards if by_buffer else record.constant
            entry = (file, line, code, what)
            if entry not in guards:
                guards.append(entry)
        except Exception:  # the record is for the finding: never fail the capture over it
            logger.debug("could not record a decided guard", exc_info=True)

    def log(self: Any, orig_expr: Any, unsound_result: Any) -> None:
        note(f"{orig_expr} is {unsound_result}")

    def wrap(original: Any) -> Any:
        nonlocal original_fakify
        original_fakify = original
        return fakify

    with fakify_params_replaced(wrap), real_tensor_decisions_logged(log), stack:
        yield
