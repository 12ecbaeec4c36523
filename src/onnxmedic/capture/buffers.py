"""Capture with the buffers' values known: Python control flow that reads a buffer.

torch.export treats every buffer as an input of unknown value, so ``if not
self.updated_strategy.item()`` (gpytorch's variational strategy), ``if t[0] > t[1]`` on a time
grid kept as a buffer (torchdiffeq), or ``if not self.data_dep_init_done > 0`` (normflows'
ActNorm) cannot be decided and the capture fails. In the ONNX file buffers are constants
(initializers), so the exported function may take the branch their current values select.

How: torch's real-tensor propagation (the machinery of draft_export), restricted to values that
do not depend on the inputs. The fake tensors of the model's buffers carry the buffers' real
values; an op whose tensor arguments all carry real values and whose arguments have no
input-derived size (no backed symbol) is also run on the real values; everything else stays
fake, as in a plain capture, and its outputs lose any real value. A guard on a data-dependent
value is then decided exactly when the value is a function of buffers and constants alone; a
guard that involves an input still fails as before. Reading a number from such a value
(``.item()``, ``bool()``) gives a Python number, so the branch leaves no trace in the program:
the buffer is read like a Python attribute, and the program keeps no unbacked symbol that a
later pass (decompositions) could not decide again. Buffers are copied up to ``CLONE_LIMIT``
bytes in all; beyond that the model's own buffers are used (onnxmedic puts back buffers the
model writes, see borrow.py).
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

logger = logging.getLogger(__name__)

CLONE_LIMIT = 64 * 2**20


@dataclass
class Decided:
    """What a buffer-valued capture decided: the guards and the buffers they read."""

    # (file, line, code, what: "reads True", "Eq(u0, 1) is False")
    guards: list[tuple[str, int, str, str]] = field(default_factory=list)
    buffers: dict[str, str] = field(default_factory=dict)  # qualified name -> value shown


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


def _from_constants(flat: list[Any], backed: Any) -> bool:
    """True when an op's arguments are constants only: every tensor carries a real value and
    nothing is sized by an input (no backed symbol; an unbacked one has a known value or
    torch does not propagate)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for a in flat:
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if a.node.expr.free_symbols & backed:
                return False
        elif isinstance(a, FakeTensor):
            if a.real_tensor is None or any(
                    isinstance(s, torch.SymInt) and s.node.expr.free_symbols & backed
                    for s in a.shape):
                return False
    return True


def _forget_values(out: Any) -> None:
    """An op that is not from constants gives no real value: a decomposition may return a
    tensor a factory inside it made (``empty_strided``, real) and an op on an input filled;
    an in-place op on a constant with an input makes it depend on the input."""
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor

    for t in pytree.tree_leaves(out):
        if isinstance(t, FakeTensor):
            t.real_tensor = None


@contextlib.contextmanager
def _constant_propagation(mode: Any, on_read: Callable[[Any], None]) -> Iterator[None]:
    """Real values only for ``mode``'s ops whose arguments are all constants; reading a number
    from such a tensor (``.item()``, ``bool()``, ``int()``) gives that number - a Python
    constant, as if the code had read a Python attribute - and calls ``on_read`` with it."""
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    scalar = torch.ops.aten._local_scalar_dense.default

    original = type(mode)._dispatch_impl
    # the program keeps this mode (its nodes' fake values): later passes (decompositions)
    # must see a plain one again
    cache = mode.cache_enabled
    mode.propagate_real_tensors, mode.cache_enabled = True, False

    def dispatch_impl(self: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if self is not mode:
            return original(self, func, types, args, kwargs)
        env = self.shape_env
        backed = set(env.backed_var_to_val) if env is not None else set()
        flat = pytree.tree_leaves((args, kwargs))
        if _from_constants(flat, backed):
            if func is scalar and isinstance(args[0], FakeTensor) \
                    and args[0].real_tensor is not None:
                with unset_fake_temporarily():
                    value = args[0].real_tensor.item()
                on_read(value)
                return value
            return original(self, func, types, args, kwargs)
        self.propagate_real_tensors = False
        try:
            out = original(self, func, types, args, kwargs)
        finally:
            self.propagate_real_tensors = True
        _forget_values(out)
        return out

    type(mode)._dispatch_impl = dispatch_impl
    try:
        yield
    finally:
        type(mode)._dispatch_impl = original
        mode.propagate_real_tensors, mode.cache_enabled = False, cache


def _guard_site() -> tuple[str, int, str, Any] | None:
    from onnxmedic.capture.validation import guarding_frame

    frame = guarding_frame(skip=(__file__.replace("\\", "/"),))
    if frame is None:
        return None
    file, line = frame.f_code.co_filename, frame.f_lineno
    return file, line, linecache.getline(file, line).strip(), frame


def _buffers_read(frame: Any, code: str, real: dict[int, str],
                  modules: dict[int, str]) -> list[str]:
    """The buffers a guard read: locals of the guarding frame (and its callers') backed by a
    buffer's value, and ``self.<buffer>`` named in the guard's line."""
    from torch._subclasses.fake_tensor import FakeTensor

    found: list[str] = []
    depth = 0
    while frame is not None and depth < 12:
        for name, value in frame.f_locals.items():
            if isinstance(value, FakeTensor) and id(value.real_tensor) in real:
                found.append(real[id(value.real_tensor)])
            elif name == "self" and id(value) in modules:
                prefix = modules[id(value)]
                for attr in re.findall(r"self\.(\w+)", code):
                    if attr in getattr(value, "_buffers", {}):
                        found.append(f"{prefix}.{attr}" if prefix else attr)
        if found:
            break
        frame, depth, code = frame.f_back, depth + 1, ""
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def buffers_known(model: torch.nn.Module, record: Decided) -> Iterator[None]:
    """Within the block, torch.export captures ``model`` with its buffers' values known (see
    the module docstring); ``record`` gets the guards decided and the buffers they read."""
    import torch.export._trace as trace
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    named = dict(model.named_buffers(remove_duplicate=False))
    shown = {n: show_value(b) for n, b in named.items()}  # now: not under fake mode
    modules = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    real: dict[int, str] = {}  # id(real tensor given to a fake) -> buffer name
    original_fakify = trace._fakify_params_buffers
    original_log = ShapeEnv._log_real_tensor_propagation
    stack = contextlib.ExitStack()

    def fakify(fake_mode: Any, mod: torch.nn.Module) -> dict[str, Any]:
        fakes = original_fakify(fake_mode, mod)
        budget = CLONE_LIMIT
        for name, buf in (named.items() if mod is model else ()):
            fake = fakes.get(name)
            if fake is None or buf.device.type == "meta" or fake.real_tensor is not None:
                continue
            size = buf.numel() * buf.element_size()
            value = real_value(buf, clone=size <= budget)
            budget -= size if size <= budget else 0
            fake.real_tensor = value
            real.setdefault(id(value), name)
        if real:
            stack.enter_context(_constant_propagation(
                fake_mode, lambda value: note(f"reads {value!r}")))
        return fakes

    def note(what: str) -> None:
        try:
            site = _guard_site()
            if site is None:
                return
            file, line, code, frame = site
            for b in _buffers_read(frame, code, real, modules):
                record.buffers.setdefault(b, shown[b])
            entry = (file, line, code, what)
            if entry not in record.guards:
                record.guards.append(entry)
        except Exception:  # the record is for the finding: never fail the capture over it
            logger.debug("could not record a decided guard", exc_info=True)

    def log(self: Any, orig_expr: Any, unsound_result: Any) -> None:
        note(f"{orig_expr} is {unsound_result}")

    trace._fakify_params_buffers = fakify
    ShapeEnv._log_real_tensor_propagation = log
    try:
        with stack:
            yield
    finally:
        trace._fakify_params_buffers = original_fakify
        ShapeEnv._log_real_tensor_propagation = original_log
