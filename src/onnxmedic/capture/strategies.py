"""Capture strategies: each returns Result(program | None, strategy, error).

Like torch.onnx's own capture strategies, every attempt is recorded so the report can list what
was tried and why it failed; unlike them, the failure is classified into a finding that points at
the user's line and says what to change.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import linecache
import logging
import os
import re
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from onnxmedic._locate import (
    exception_chain,
    is_user_file,
    location_from_exception,
    location_from_frame,
)
from onnxmedic._torch_compat import (
    backed_size_oblivious,
    dynamo_knows_builtins,
    parameters_carry_values,
    record_specialisations,
    stop_real_tensor_propagation,
    unused_constants_dropped,
)
from onnxmedic.borrow import record_state, restore_state
from onnxmedic.capture.byte_masks import byte_masks_as_bool
from onnxmedic.capture.caches import CachesOff
from onnxmedic.capture.decomps import symbolic_shape_rules
from onnxmedic.capture.detection import Rewritten
from onnxmedic.capture.equal import equal_as_guard
from onnxmedic.findings import Finding, Location, error
from onnxmedic.noise import torch_logs_to

logger = logging.getLogger(__name__)
STAGE = "capture"


@dataclass
class Result:
    program: torch.export.ExportedProgram | None
    strategy: str
    error: BaseException | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    registered: dict[str, str] = field(default_factory=dict)  # pytree registrations made
    neutralised: Any = None  # validation.Neutralised: what a validation-off capture changed
    constants: dict[str, int] = field(default_factory=dict)  # buffers fixed to their values
    decided: Any = None  # buffers.Decided: guards decided by buffer values, buffers they read
    # input dim ("L['x'].size()[3]") -> (guard that fixed it to a number, Python stack there)
    specialised: dict[str, tuple[str, list[Any]]] = field(default_factory=dict)
    packed: Any = None  # packed.PackedRewrites: the packed RNN calls captured padded
    kept: Any = None  # sizes.Kept: lines whose sizes the capture kept symbolic
    # torch.equal calls whose outcome was read from the values (capture.equal.EqualSite)
    equal: list[Any] = field(default_factory=list)
    # (input dim, guard, Python stack) of the guards that divide or bound one input dim
    size_guards: list[tuple[str, str, list[Any]]] = field(default_factory=list)
    # (library, switch, what its cache keys on the sizes) of the size-keyed library caches
    # switched off for this attempt (capture.caches)
    caches: list[tuple[str, str, str]] = field(default_factory=list)
    # torchvision functions replaced for the capture (capture.detection.Rewritten.on)
    rewrites: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.program is not None

    def summary(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "ok": self.ok, "seconds": round(self.seconds, 3),
                "error": _short_error(self.error) if self.error else None}


def _short_error(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}"[:500]


class CaptureStrategy:
    name = "base"
    kept: Any = None  # sizes.Kept of the attempt under way (set by the strategies that keep)
    # torch.equal computed as a data-dependent guard (capture.equal), and uint8 index masks
    # indexed with as bool (capture.byte_masks), during the capture: for the strategies that
    # run the model's Python (not TorchDynamo's strict tracing)
    equal_as_guard = True

    def __call__(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 dynamic_shapes: Any, previous: list[Result] | tuple[()] = ()) -> Result:
        """One capture attempt; ``previous``: the attempts before it (for strategies that
        react to an earlier failure)."""
        t0 = time.perf_counter()
        # torch.export writes graph dumps to stderr when it fails; keep them for the report
        # instead of burying onnxmedic's own message under them
        buf = io.StringIO()
        equal: list[Any] = []
        size_guards: list[tuple[str, str, list[Any]]] = []
        # what the attempt writes on the model and the objects it holds (a memo cache filled
        # with the trace's fake tensors) is put back after it, so that no later attempt, and
        # no later call of the model, reads a tensor of this trace
        state = record_state(model, values=False, reach=True)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stderr(buf), \
                    torch_logs_to(buf), \
                    record_specialisations(bool(dynamic_shapes), size_guards) as fixed, \
                    unused_constants_dropped(), \
                    (equal_as_guard(equal) if self.equal_as_guard else contextlib.nullcontext()), \
                    (byte_masks_as_bool() if self.equal_as_guard else contextlib.nullcontext()):
                warnings.simplefilter("ignore")
                program = self._capture(model, args, kwargs, dynamic_shapes)
        except Exception as e:
            return Result(None, self.name, e, time.perf_counter() - t0,
                          notes=[buf.getvalue()[-4000:]] if buf.getvalue() else [],
                          specialised=fixed, equal=equal)
        finally:
            restore_state(state)
        return Result(program, self.name, None, time.perf_counter() - t0, kept=self.kept,
                      specialised=fixed, equal=equal, size_guards=size_guards)

    def _capture(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 dynamic_shapes: Any) -> torch.export.ExportedProgram:
        raise NotImplementedError


def size_oblivious(dynamic_shapes: Any, strict: bool = False, oblivious: bool = True) -> Any:
    """With dynamic shapes, capture like torch.onnx does: backed_size_oblivious=True, so that a
    size computed from a dynamic dim that happens to be 1 at the example (RegNet's last stage at
    32 px: 32 // 32) is not specialised to 1 - which bakes a static shape into the graph and
    fails in ONNX Runtime at other sizes; onnxmedic's size-symbolic shape rules
    (capture.decomps: LSTM/GRU, affine_grid), where torch's own fix a dynamic size; and, when
    Python runs as-is (not ``strict``), ``len(tensor)`` kept symbolic (``symbolic_len``).
    ``oblivious=False``: all but backed_size_oblivious (SizesBacked). Without dynamic shapes
    only ``symbolic_len`` (not ``strict``): a data-dependent size has no example value to be
    specialised to, so ``len()`` of it must stay symbolic (torchvision's MultiScaleRoIAlign:
    ``len(rois)``, reached non-strict when the user's wrapper defeats TorchDynamo)."""
    if not dynamic_shapes:
        return contextlib.nullcontext() if strict else symbolic_len()
    stack = contextlib.ExitStack()
    if oblivious:
        stack.enter_context(backed_size_oblivious())
    stack.enter_context(symbolic_shape_rules())
    if not strict:
        stack.enter_context(symbolic_len())
    return stack


@contextlib.contextmanager
def symbolic_len() -> Any:
    """Within the block, ``len(t)`` of a tensor whose first size is symbolic gives that size,
    a SymInt, as TorchDynamo traces it (``torch.export(strict=True)``), instead of the int the
    builtin must return - which specialises a dynamic batch to the example's wherever a model
    sizes a tensor by it (normflows' ``torch.zeros(len(x))``). Where an int is needed after
    all (``range(len(t))``) the SymInt becomes one with the same guard as before. Non-strict
    capture only: like torch.export's own ``builtins.max``/``min`` override, put back after."""
    dynamo_knows_builtins()
    original = builtins.len

    def len_(obj: Any, /) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0:
            first = obj.shape[0]
            if isinstance(first, torch.SymInt):
                return first
        return original(obj)

    builtins.len = len_
    try:
        yield
    finally:
        builtins.len = original


class TorchExportNonStrict(CaptureStrategy):
    """torch.export.export(strict=False): Python runs as-is, tensors are traced. With dynamic
    shapes, ``torch.as_tensor`` of a symbolic size builds the tensor from it (capture.sizes)."""

    name = "torch.export(strict=False)"

    def _capture(self, model, args, kwargs, dynamic_shapes):
        from onnxmedic.capture.sizes import Kept, symbolic_factories

        self.kept = Kept()
        with size_oblivious(dynamic_shapes), \
                symbolic_factories(self.kept, active=bool(dynamic_shapes)):
            return torch.export.export(model, args, kwargs=kwargs,
                                       dynamic_shapes=dynamic_shapes, strict=False)


class SizesBacked(TorchExportNonStrict):
    """After a failure on sizes torch lost track of (PendingUnbackedSymbolNotFound: under
    backed_size_oblivious, which capture turns on for dynamic shapes, a slice whose bounds
    depend on a branch on the size - FNO's mode selection, ``if start`` on ``max_modes -
    min(size, n_modes)`` - gets unbacked bounds torch then cannot bind), or after a broadcast
    of symbolic sizes it could not prove (a size of ``1 - Max(0, ...)``, MPT's ALiBi bias with
    a cache): torch.export(
    strict=False) with ordinary backed sizes, as torch.export runs by default. A branch on a
    size then follows the example's sizes and is kept as a guard on the dim (``size >= 4``),
    not dropped: verification runs the dims at other sizes and a file valid only at some sizes
    says so (OM408). Applies only with dynamic shapes."""

    name = "torch.export(strict=False), backed sizes"

    def check(self, previous: list[Result], args: tuple[Any, ...], kwargs: dict[str, Any],
              model: torch.nn.Module | None = None) -> str | None:
        if not any(_UNBACKED_LOST.search(f"{type(r.error).__name__}: {r.error}")
                   or _OBLIVIOUS_BROADCAST.search(str(r.error))
                   for r in previous if r.error is not None):
            return ("no earlier attempt lost an unbacked size or failed to broadcast a "
                    "symbolic size")
        return None

    def __call__(self, model, args, kwargs, dynamic_shapes, previous=()):
        if not dynamic_shapes:
            return Result(None, self.name, RuntimeError("no dynamic shapes"))
        return super().__call__(model, args, kwargs, dynamic_shapes, previous)

    def _capture(self, model, args, kwargs, dynamic_shapes):
        from onnxmedic.capture.sizes import Kept, symbolic_factories

        self.kept = Kept()
        with size_oblivious(dynamic_shapes, oblivious=False), \
                symbolic_factories(self.kept, active=bool(dynamic_shapes)):
            return torch.export.export(model, args, kwargs=kwargs,
                                       dynamic_shapes=dynamic_shapes, strict=False)


_UNBACKED_LOST = re.compile(r"PendingUnbackedSymbolNotFound|Pending unbacked symbols")
# a broadcast of symbolic sizes backed_size_oblivious cannot prove (MPT's ALiBi bias sliced at
# max(0, 1 - query_length): its query dim is 1 for every size, but only the sizes' own values
# show it)
_OBLIVIOUS_BROADCAST = re.compile(r"The size of tensor a \(.*\bs\d+.*\) must match the size of "
                                  r"tensor b \(.*\bMax\(.*\) at non-singleton dimension")


class TorchExportStrict(CaptureStrategy):
    """torch.export.export(strict=True): TorchDynamo traces the bytecode."""

    name = "torch.export(strict=True)"
    equal_as_guard = False

    def _capture(self, model, args, kwargs, dynamic_shapes):
        with size_oblivious(dynamic_shapes, strict=True):
            return torch.export.export(model, args, kwargs=kwargs,
                                       dynamic_shapes=dynamic_shapes, strict=True)


class RegisterPytreeTypes(TorchExportNonStrict):
    """When torch.export cannot flatten an output or input type (Hugging Face ``Cache``
    objects): register the classes with torch.utils._pytree, then torch.export(strict=False)
    again. Applies only after an attempt failed on such a type."""

    name = "pytree registration + torch.export(strict=False)"

    def __init__(self) -> None:
        self.registered: dict[str, str] = {}
        self.problems: list[str] = []

    def check(self, previous: list[Result], args: tuple[Any, ...], kwargs: dict[str, Any],
              model: torch.nn.Module | None = None) -> str | None:
        """None when the strategy applies, else the reason it does not."""
        from onnxmedic.capture import hf

        errors = [r.error for r in previous if r.error is not None]
        if not errors:
            return "no earlier attempt failed"
        if not any(hf.unknown_type_names(e) for e in errors) and not hf.unknown_types_in(
                (args, kwargs)):
            return "no earlier attempt failed on an unknown output or input type"
        return None

    def __call__(self, model, args, kwargs, dynamic_shapes, previous=()):
        from onnxmedic.capture import hf

        err = next((r.error for r in previous if r.error is not None), None)
        self.registered, self.problems = hf.register_unknown_types(err, args, kwargs)
        res = super().__call__(model, args, kwargs, dynamic_shapes)
        res.registered = dict(self.registered)
        res.notes.extend(f"not registered: {p}" for p in self.problems)
        return res


_PACKED_FILES = ("torch/nn/utils/rnn.py", "torch/nn/modules/rnn.py")


def _packed_failure(previous: list[Result]) -> str | None:
    """None when an earlier attempt failed in the packed-sequence path (torch.nn.utils.rnn or
    an RNN module's forward, or strict mode refusing pack_padded_sequence), else why not."""
    import traceback

    errors = [r.error for r in previous if r.error is not None]
    if not errors:
        return "no earlier attempt failed"
    for e in errors:
        for x in exception_chain(e):
            if "pack_padded_sequence" in str(x) or any(
                    f.filename.replace("\\", "/").endswith(_PACKED_FILES)
                    for f in traceback.extract_tb(x.__traceback__)):
                return None
    return "no earlier attempt failed in a packed sequence or an RNN module"


class PackedSequences(TorchExportNonStrict):
    """After a failure in the packed-sequence path: torch.export(strict=False) with
    pack_padded_sequence -> nn.RNN/GRU/LSTM -> pad_packed_sequence kept padded (one
    ``onnxmedic::padded_rnn`` op on the padded batch and the lengths, ONNX's RNN ops with
    sequence_lens in the file) - the same values, see capture/packed.py; OM207 says where."""

    name = "torch.export(strict=False), packed sequences kept padded"

    def check(self, previous: list[Result], args: tuple[Any, ...], kwargs: dict[str, Any],
              model: torch.nn.Module | None = None) -> str | None:
        if model is not None and not any(isinstance(m, torch.nn.RNNBase)
                                         for m in model.modules()):
            return "the model has no nn.RNN, nn.GRU or nn.LSTM"
        return _packed_failure(previous)

    def __call__(self, model, args, kwargs, dynamic_shapes, previous=()):
        from onnxmedic.capture.packed import PackedRewrites, packed_as_padded

        record = PackedRewrites()
        with packed_as_padded(model, record):
            res = super().__call__(model, args, kwargs, dynamic_shapes)
        res.packed = record
        return res


class SymbolicSizes(TorchExportNonStrict):
    """When a line fixed a declared dim by making a Python number of it with ``float()`` or
    ``int()`` (kornia's ``float(width - 1) / 2``, einx's ``int(x) for x in tensor.shape``):
    torch.export(strict=False) again with that module's ``float``/``int`` keeping a symbolic
    size symbolic (``torch.sym_float``, as TorchDynamo traces them; capture.sizes). Up to
    four rounds, each adding the modules the last attempt's specialising lines are in. The
    same numbers are computed; a later use that needs a Python number still guards, and
    verification runs the declared dims at other sizes (OM127 names the lines)."""

    name = "torch.export(strict=False), sizes kept symbolic"

    def check(self, previous: list[Result], args: tuple[Any, ...], kwargs: dict[str, Any],
              model: torch.nn.Module | None = None) -> str | None:
        if not _converting_modules(previous):
            return "no earlier attempt fixed a dim with int() or float()"
        return None

    def __call__(self, model, args, kwargs, dynamic_shapes, previous=()):
        from onnxmedic.capture.sizes import Kept, sizes_stay_symbolic

        modules = _converting_modules(list(previous))
        res = None
        for _ in range(4):
            record = Kept()
            with sizes_stay_symbolic(modules, record):
                res = super().__call__(model, args, kwargs, dynamic_shapes)
            more = [m for m in _converting_modules([res]) if m not in modules]
            if res.ok or not more:
                break
            modules += more
        assert res is not None
        if res.kept is not None:
            record.lines += [e for e in res.kept.lines if e not in record.lines]
        res.kept = record
        return res


def _converting_modules(previous: list[Result]) -> list[str]:
    from onnxmedic.capture.sizes import converting_modules

    found: list[str] = []
    for r in previous:
        found += [m for m in converting_modules(r.specialised, _is_internal) if m not in found]
    return found


def _data_dependent_failure(previous: list[Result]) -> str | None:
    texts = " ".join(f"{type(r.error).__name__}: {r.error}" for r in previous
                     if r.error is not None)
    if not texts:
        return "no earlier attempt failed"
    if not _DATA_DEPENDENT.search(texts):
        return "no earlier attempt failed on data-dependent control flow"
    return None


def _with_validation_off(capture_: Any, model: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any], dynamic_shapes: Any) -> Result:
    """``capture_(model, args, kwargs, dynamic_shapes)`` with validation off (see
    capture/validation.py); the result records what was switched off or decided."""
    from onnxmedic.capture.validation import Neutralised, validation_off

    record = Neutralised()
    with validation_off(record):
        res = capture_(model, args, kwargs, dynamic_shapes)
    res.neutralised = record
    return res


class ValidationOff(TorchExportNonStrict):
    """After a failure on data-dependent control flow: torch.export(strict=False) with the
    validation switches of the libraries in use turned off and check-only branches (an
    ``assert``, an ``if`` that only raises or warns) decided as not raising - see
    capture/validation.py. Sound for every input on which the eager model does not raise;
    the settings are restored afterwards and the finding (OM115) says what was changed."""

    name = "torch.export(strict=False), validation off"

    def check(self, previous: list[Result], args: tuple[Any, ...], kwargs: dict[str, Any],
              model: torch.nn.Module | None = None) -> str | None:
        return _data_dependent_failure(previous)

    def __call__(self, model, args, kwargs, dynamic_shapes, previous=()):
        return _with_validation_off(super().__call__, model, args, kwargs, dynamic_shapes)


def constant_scalar_buffers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, int]]:
    """The model's 0-d integer (or bool) buffers registered non-persistent: {qualified name:
    (module, buffer name, value)}. No checkpoint sets them (they are not in the state dict), so
    their value is what __init__ derived from the config."""
    found: dict[str, tuple[torch.nn.Module, str, int]] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for name, buf in mod._buffers.items():
            if (buf is None or name not in mod._non_persistent_buffers_set or buf.dim() != 0
                    or buf.is_floating_point() or buf.is_complex() or buf.device.type == "meta"):
                continue
            found.setdefault(f"{prefix}.{name}" if prefix else name, (mod, name, buf.item()))
    return found


@contextlib.contextmanager
def buffers_as_constants(found: dict[str, tuple[torch.nn.Module, str, int]]) -> Any:
    """Within the block, reading one of ``found``'s buffers gives a new tensor of its value -
    a tensor made from a Python number, whose value torch.export knows - instead of the buffer,
    whose value it does not. Each module gets a subclass of its own class with a property per
    buffer (a property wins over Module.__getattr__, which serves buffers); the buffers, the
    state dict and every other attribute stay as they are, and the class is put back after."""
    by_module: dict[int, tuple[torch.nn.Module, dict[str, Any]]] = {}
    for mod, name, value in found.values():
        by_module.setdefault(id(mod), (mod, {}))[1][name] = (value, mod._buffers[name].dtype)
    swapped: list[tuple[torch.nn.Module, type]] = []

    def constant(value: int, dtype: torch.dtype) -> property:
        return property(lambda self: torch.tensor(value, dtype=dtype))

    try:
        for mod, consts in by_module.values():
            cls = type(mod)
            sub = type(cls.__name__, (cls,), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                **{n: constant(v, dt) for n, (v, dt) in consts.items()}})
            try:
                mod.__class__ = sub
            except TypeError:  # a class whose layout forbids it: leave that module alone
                logger.debug("cannot specialise buffers of %s", cls, exc_info=True)
                continue
            swapped.append((mod, cls))
        yield
    finally:
        for mod, cls in swapped:
            mod.__class__ = cls


class KnownBuffers(TorchExportNonStrict):
    """When Python control flow reads a value that depends on no input. torch.export treats
    every buffer and parameter as an unknown input, and a tensor the model makes in forward
    from constants (``torch.linspace(0, 1, n)``) as a value it does not know; in the ONNX file
    buffers and parameters are constants (initializers) and such a tensor is the same on every
    call. So capture again with these values known and decide such branches by them:

    * a config constant kept in a 0-d integer buffer registered non-persistent (EnCodec's conv
      ``stride``, ``padding_total``: ``if length <= max(padding_total, extra_padding)``) is
      read as a Python-known constant, so guards that also involve a dynamic size stay
      symbolic (``buffers_as_constants``);
    * every other buffer and parameter carries its value, and every op whose arguments are
      such values, constants and static sizes is run on the values too (capture.buffers): a
      guard on a value computed from them alone is decided by it (gpytorch's
      ``updated_strategy`` flag, a time grid kept as a buffer, normflows'
      ``data_dep_init_done``: OM116; torchcde's time grid built by ``torch.linspace`` and
      torchdiffeq's fixed-step count from it, a parameter's sign: OM119); a guard that
      involves an input fails as before, as does one on random numbers.

    With validation off as well (ValidationOff), since a model may need both. Verification
    compares the ONNX model with the eager model as it is. Applies only after an attempt
    failed on data-dependent control flow."""

    name = "torch.export(strict=False), constant values known"

    def __init__(self) -> None:
        self.found: dict[str, tuple[torch.nn.Module, str, int]] = {}

    def check(self, previous: list[Result], args: tuple[Any, ...], kwargs: dict[str, Any],
              model: torch.nn.Module | None = None) -> str | None:
        return _data_dependent_failure(previous)

    def __call__(self, model, args, kwargs, dynamic_shapes, previous=()):
        from onnxmedic.capture.buffers import Decided, buffers_known
        from onnxmedic.capture.validation import Neutralised, validation_off

        self.found = constant_scalar_buffers(model)
        record, decided = Neutralised(), Decided()
        with validation_off(record), buffers_as_constants(self.found), \
                buffers_known(model, decided):
            res = super().__call__(model, args, kwargs, dynamic_shapes)
        res.neutralised = record
        res.decided = decided
        res.constants = {k: v for k, (_, _, v) in self.found.items()}
        return res


class DraftExportSpecialised(CaptureStrategy):
    """Last resort for data-dependent Python control flow: torch.export.draft_export, which
    follows the branch the example takes and keeps going. The program (and so the ONNX model)
    computes that branch for every input: the export stage says so loudly (OM114) and
    verification adds input sets meant to take the other branch, so a divergence shows up as
    a mismatch instead of shipping unnoticed. Applies only after an attempt failed on
    data-dependent control flow."""

    name = "torch.export.draft_export (branch specialised to the example)"
    specialises = True

    def check(self, previous: list[Result], args: tuple[Any, ...], kwargs: dict[str, Any],
              model: torch.nn.Module | None = None) -> str | None:
        return _data_dependent_failure(previous)

    def __call__(self, model, args, kwargs, dynamic_shapes, previous=()):
        # with validation off too, so that only the genuinely data-dependent branches are
        # specialised to the example
        return _with_validation_off(super().__call__, model, args, kwargs, dynamic_shapes)

    def _capture(self, model, args, kwargs, dynamic_shapes):
        from onnxmedic.capture.sizes import Kept, symbolic_factories

        self.kept = Kept()
        with size_oblivious(dynamic_shapes), parameters_carry_values(model), \
                symbolic_factories(self.kept, active=bool(dynamic_shapes)):
            program = torch.export.draft_export(model, args, kwargs=kwargs,
                                                dynamic_shapes=dynamic_shapes)
        stop_real_tensor_propagation(program)
        return program


CAPTURE_STRATEGIES: list[type[CaptureStrategy]] = [TorchExportNonStrict, RegisterPytreeTypes,
                                                   SymbolicSizes, TorchExportStrict, SizesBacked,
                                                   PackedSequences, ValidationOff,
                                                   KnownBuffers,
                                                   DraftExportSpecialised]


def capture(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            dynamic_shapes: Any = None,
            strategies: list[type[CaptureStrategy]] | None = None,
            skipped: list[tuple[str, str]] | None = None) -> list[Result]:
    """Try each strategy in turn; stop at the first that works. Returns every attempt; a
    strategy whose ``check`` gives a reason not to apply is skipped, and (name, reason) is
    added to ``skipped``."""
    from onnxmedic.ops import REGISTRY

    # the op families may make ops traceable (e.g. ops.pooling's fake kernel for _ctc_loss),
    # so they must be loaded before torch.export runs, not only before translation
    REGISTRY.load_builtin()
    results: list[Result] = []
    with CachesOff() as caches, Rewritten(model) as rewritten:
        for cls in strategies or CAPTURE_STRATEGIES:
            strategy = cls()
            check = getattr(strategy, "check", None)
            if check is not None:
                reason = check(results, args, kwargs, model=model)
                if reason is not None:
                    logger.debug("capture %s skipped: %s", strategy.name, reason)
                    if skipped is not None:
                        skipped.append((strategy.name, reason))
                    continue
            res = _attempt(strategy, caches, model, args, kwargs, dynamic_shapes, results)
            if not res.ok and caches.switch(caches.implicated(res)):
                # it failed in a size-keyed library cache: again with the cache switched off,
                # which stays off for the attempts after it
                res = _attempt(cls(), caches, model, args, kwargs, dynamic_shapes, results)
            if res.ok:
                if cls is not SymbolicSizes and SymbolicSizes in (strategies
                                                                  or CAPTURE_STRATEGIES):
                    extra = _unfixed(res, model, args, kwargs, dynamic_shapes)
                    for r in extra:
                        r.caches = caches.described()
                        if r.caches:
                            r.strategy += ", size-keyed caches off"
                    results += extra
                break
        for r in results:
            r.rewrites = list(rewritten.on)
    return results


def _attempt(strategy: CaptureStrategy, caches: CachesOff, model: torch.nn.Module,
             args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_shapes: Any,
             results: list[Result]) -> Result:
    """One strategy's attempt, appended to ``results``; named and recorded with the library
    caches switched off for it."""
    res = strategy(model, args, kwargs, dynamic_shapes, previous=results)
    res.caches = caches.described()
    if res.caches:
        res.strategy += ", size-keyed caches off"
    results.append(res)
    logger.debug("capture %s: %s", res.strategy, "ok" if res.ok else res.error)
    return res


class SizeFixed(Exception):
    """A capture that worked but fixed a declared dim by ``int()``/``float()`` without
    torch.export refusing it (a guard on ``TruncToInt(0.5*s1)``: not one it reports)."""


def _unfixed(res: Result, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             dynamic_shapes: Any) -> list[Result]:
    """When a capture that worked fixed a declared dim with ``int()``/``float()`` all the same
    (torch.export reports only guards it can solve for the dim), capture again with the sizes
    kept symbolic; if that works, the first attempt counts as failed (SizeFixed, the program
    dropped). Otherwise the first stands, and verification at other sizes judges it."""
    if not _converting_modules([res]):
        return []
    retry = SymbolicSizes()(model, args, kwargs, dynamic_shapes, previous=[res])
    if not retry.ok:
        return []
    fixed = "; ".join(f"{src} by `{g}`" for src, (g, _) in res.specialised.items())
    res.program, res.error = None, SizeFixed(
        f"the capture fixed declared dims with int() or float(): {fixed}")
    return [retry]


_DATA_DEPENDENT = re.compile(
    r"data.dependent|DataDependentOutputException|GuardOnDataDependentSymNode|Could not guard on data-dependent|"
    r"Could not extract specialized integer from data-dependent|\.item\(\)|"
    r"Dynamic control flow is not supported|generic_jump", re.IGNORECASE)
_TYPES = re.compile(r"pytree|not a supported (?:input|output)|Unsupported (?:input|output) type|"
                    r"register_(?:pytree_node|dataclass)|is not a.*Tensor", re.IGNORECASE)
_DYNAMIC = re.compile(r"Constraints violated|specialized|not in range|Dim\(", re.IGNORECASE)


def _outside_torch(filename: str) -> bool:
    p = filename.replace("\\", "/")
    return "/torch/" not in p or "/torch/distributions/" in p


def guard_line(failed: list[Result]) -> tuple[str, int, str] | None:
    """(file, line, code) of the statement whose data-dependent guard stopped the capture:
    the innermost traceback frame outside torch's tracing machinery and onnxmedic, taken from
    the constant-values attempt when there is one (its checks and the guards on values that
    depend on no input are already past, so it names the branch on an input that is left),
    else the validation-off attempt, else the first attempt that failed on a guard."""
    import linecache
    import traceback

    from onnxmedic._locate import PKG_DIR
    from onnxmedic.capture.validation import TRACER_FILES

    ordered = sorted(failed, key=lambda r: (KnownBuffers.name not in r.strategy,
                                            "validation off" not in r.strategy))
    for r in ordered:
        if "draft_export" in r.strategy or not _DATA_DEPENDENT.search(
                f"{type(r.error).__name__}: {r.error}"):
            continue
        for e in reversed(exception_chain(r.error)):  # the original exception first
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if not f.filename.startswith("<")
                      and PKG_DIR not in f.filename.replace("\\", "/")
                      and not any(t in f.filename.replace("\\", "/") for t in TRACER_FILES)
                      and _outside_torch(f.filename)]
            if frames:
                f = frames[-1]
                code = (f.line or linecache.getline(f.filename, f.lineno)).strip()
                return f.filename, f.lineno, code
    return None


def _while_at(filename: str, lineno: int) -> ast.While | None:
    """The innermost ``while`` loop (not ``while True``) whose test or body spans ``lineno``."""
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source) if source else None
    except SyntaxError:
        tree = None
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.While) and not isinstance(node.test, ast.Constant) \
                and node.lineno <= lineno <= (node.end_lineno or node.lineno) \
                and (best is None or node.lineno >= best.lineno):
            best = node
    return best


def _user_frames(failed: list[Result], draft: bool = False) -> list[list[Any]]:
    """The traceback frames outside torch and onnxmedic of each failed attempt (each error
    of its chain), innermost last; with ``draft``, draft_export's attempts first."""
    import traceback

    from onnxmedic.capture.validation import TRACER_FILES

    out = []
    for r in sorted(failed, key=lambda r: draft and "draft_export" not in r.strategy):
        out += [[f for f in traceback.extract_tb(x.__traceback__)
                 if not _is_internal(f.filename)
                 and not any(t in f.filename.replace("\\", "/") for t in TRACER_FILES)]
                for x in exception_chain(r.error)]
    return out


# torchdiffeq's adaptive-step machinery: the adaptive Runge-Kutta base class and its solvers,
# and the initial step selection only they call
_ADAPTIVE_ODE = re.compile(r"torchdiffeq/_impl/(?:rk_common|dopri5|dopri8|bosh3|adaptive_heun|"
                           r"fehlberg2|scipy_wrapper)\.py$")


def adaptive_ode_solver(failed: list[Result]) -> tuple[str, int, str] | None:
    """(file, line, code) of the innermost torchdiffeq adaptive-solver frame a failed attempt
    went through (its step count depends on the values), or None."""
    for frames in _user_frames(failed, draft=True):
        for f in reversed(frames):
            p = f.filename.replace("\\", "/")
            if _ADAPTIVE_ODE.search(p) or p.endswith("torchdiffeq/_impl/misc.py") and \
                    f.name == "_select_initial_step":
                return f.filename, f.lineno or 0, (f.line or "").strip()
    return None


def value_loop(failed: list[Result]) -> tuple[str, int, str] | None:
    """(file, line, code) of the ``while`` loop a data-dependent guard stopped the capture in:
    the innermost traceback frame outside torch and onnxmedic that runs inside such a loop,
    the attempts that went farthest (draft_export) first. A loop whose condition reads tensor
    values runs a number of times the values decide (an adaptive ODE solver's steps)."""
    for frames in _user_frames(failed, draft=True):
        for f in reversed(frames):
            loop = _while_at(f.filename, f.lineno or 0)
            if loop is not None:
                return f.filename, loop.lineno, linecache.getline(
                    f.filename, loop.lineno).strip()
    return None


def _loop_suggestion(loop: tuple[str, int, str], loc: Location | None) -> str:
    file, line, code = loop
    what = (f"the loop at {file}:{line}, `{code}`" if code.startswith("while ")
            else f"its step-size selection at {file}:{line}")
    text = (f"The loop at {file}:{line} (`{code}`) runs while a condition on tensor values "
            "holds, so how many times it runs depends on the values; an ONNX graph has a fixed "
            "structure. Bound it (a fixed number of iterations) or write it with "
            "torch._higher_order_ops.while_loop.")
    if "torchdiffeq/_impl/" in file.replace("\\", "/"):
        at = f" at {loc.file}:{loc.line} (`{loc.code}`)" if loc and loc.code else ""
        text = ("torchdiffeq's adaptive solvers (dopri5, dopri8, bosh3, fehlberg2, "
                f"adaptive_heun) choose how many steps to take from the values ({what}), "
                f"which no ONNX graph can follow. In the call{at} use a fixed-step method"
                ": `method='rk4', options={'step_size': h}` (or 'euler', "
                "'midpoint'), with h small enough for the accuracy the adaptive solver gave "
                "you; the step count is then fixed by the time grid.")
    return text


_RAISED_AT = re.compile(r'The following call raised this error:\s*\n\s*File "([^"]+)", line (\d+), '
                        r'in (\S+)\n[ \t]*([^\n]*)')


def raised_at(text: str) -> str | None:
    """'file:line in function (`code`)' of the line torch.export names as the one that raised
    ("The following call raised this error: File ..."), which may be in a library the user's
    code calls (transformers' modeling code), or None."""
    m = _RAISED_AT.search(text)
    if m is None:
        return None
    file, line, function, code = m.groups()
    return f"{file}:{line} in {function}" + (f" (`{code.strip()}`)" if code.strip() else "")


_SPECIALISED_DIM = re.compile(r"(L\['[A-Za-z_]\w*'\]\.size\(\)\[\d+\]) as dynamic but your code "
                              r"specialized it to be a constant \((-?\d+)\)")


def _is_internal(path: str) -> bool:
    """torch's, onnxmedic's or the standard library's own frames."""
    p = path.replace("\\", "/")
    return p.startswith("<") or any(p.startswith(d) for d in _INTERNAL_DIRS)


_INTERNAL_DIRS = tuple(
    d.replace("\\", "/").rstrip("/") + "/" for d in (
        os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
        sysconfig.get_paths()["stdlib"]))


def specialising_lines(failed: list[Result], texts: str
                       ) -> list[tuple[str, str, str, Location, Location | None]]:
    """For each dim torch.export says the code specialised: (input dim as ``x[2]``, the size,
    the guard, the innermost line outside torch that added the guard - a library's or the
    user's -, the user's own innermost line on the way there)."""
    out = []
    for source, size in dict(_SPECIALISED_DIM.findall(texts)).items():
        rec = next((r.specialised[source] for r in failed if source in r.specialised), None)
        if rec is None:
            continue
        guard, stack = rec
        frames = [f for f in stack if not _is_internal(f.filename)]
        if not frames:
            continue
        at = frames[-1]
        user = next((f for f in reversed(frames) if is_user_file(f.filename)), None)
        m = re.match(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]", source)
        dim = f"{m.group(1)}[{m.group(2)}]" if m else source
        out.append((dim, size, guard, location_from_frame(at), location_from_frame(user) if user is not None else None))
    return out


def guard_locations(size_guards: list[tuple[str, str, list[Any]]]
                    ) -> dict[str, list[tuple[str, Location]]]:
    """Input dim (``L['x'].size()[2]``) -> [(a guard that divides or bounds it, the innermost
    line outside torch that added it - a library's or the user's)], in the order torch.export
    added them, from ``Result.size_guards``."""
    out: dict[str, list[tuple[str, Location]]] = {}
    for source, guard, stack in size_guards:
        frames = [f for f in stack if not _is_internal(f.filename)]
        if frames:
            out.setdefault(source, []).append((guard, location_from_frame(frames[-1])))
    return out


def _packed_use_finding(failed: list[Result], tried: str, loc: Location | None,
                        details: dict[str, Any]) -> Finding | None:
    """OM208 when an attempt failed on a packed-sequence use capture/packed.py does not cover
    (the error names it), else None."""
    from onnxmedic.capture.packed import PackedUseUnsupported

    for r in failed:
        for e in exception_chain(r.error):
            if isinstance(e, PackedUseUnsupported):
                return error("OM208", STAGE, f"{e}. Tried: {tried}",
                             location=location_from_exception(e) or loc,
                             suggestion="Keep the packed sequence between pack_padded_sequence, "
                             "the RNN module and pad_packed_sequence (apply per-step layers to "
                             "the padded output, masking by the lengths), or export with a "
                             "fixed batch of equal-length sequences.", details=details)
    return None


_BRANCH_SUGGESTION = (
    "Rewrite the branch with torch.cond or torch.where, e.g. `if x.sum() > 0: y = f(x) else: "
    "y = g(x)` becomes `y = torch.cond(x.sum() > 0, lambda x: f(x), lambda x: g(x), (x,))`; "
    "a value-dependent shape needs torch._check on the value's range.")


def _size_bound_text(failed: list[Result], details: dict[str, Any]) -> tuple[str, str] | None:
    """(sentence for the message, suggestion) when a library that computes with the sizes as
    Python ints by design (capture.caches.SIZE_BOUND: einx) fixed a declared dim, naming its
    line and the call into it; None otherwise. ``details["size_bound"]`` lists them."""
    from onnxmedic.capture.caches import size_bound_calls

    calls = size_bound_calls([stack for r in failed for _g, stack in r.specialised.values()],
                             _is_internal)
    if not calls:
        return None

    def where(f: Any) -> str:
        return f"{f.filename}:{f.lineno}" + (f" (`{f.line.strip()}`)" if f.line else "")

    details["size_bound"] = [{"library": c.bound.library, "at": f"{c.at.filename}:{c.at.lineno}",
                              "call": f"{c.call.filename}:{c.call.lineno}" if c.call else None}
                             for c in calls]
    first = calls[0]
    sites = "; ".join(where(c.call) for c in calls if c.call is not None) or "?"
    text = (f"{first.bound.library} fixes them at {first.at.filename}:{first.at.lineno}, "
            f"called from {sites}: {first.bound.why}, so no capture can keep these dims "
            "dynamic.")
    return text, first.bound.change.format(call=sites)


def _constrained_finding(failed: list[Result], texts: str, first: BaseException,
                         loc: Location | None, details: dict[str, Any]) -> Finding:
    """OM401: a dim declared dynamic that the model specialises or constrains, with the lines
    that fixed it and (capture.caches.SIZE_BOUND) the library that computes with sizes."""
    why = [ln.strip()[2:] for ln in texts.splitlines()
           if ln.strip().startswith("- ") and ("Not all values" in ln or "specialized" in ln
                                               or " = " in ln)]
    why = list(dict.fromkeys(why))[:3]  # each attempt repeats them
    fixed_by = specialising_lines(failed, texts)
    suggestion = ("Apply the fix torch.export suggests (in the details), or "
                  "declare that dimension static.")
    if fixed_by:
        details["fixed_by"] = [{"dim": d, "size": n, "guard": g, "at": str(at),
                                "code": at.code, "user_line": str(u) if u else None}
                               for d, n, g, at, u in fixed_by]
        loc = fixed_by[0][3]
        suggestion = ("The line named turns the size into a Python number (or loops over "
                      "it), which no ONNX shape can follow. Declare the dim static to "
                      "export at that size (dynamic_shapes: None for it; the file then "
                      "accepts only that size), or keep the size a tensor op there.")
    bound = _size_bound_text(failed, details)
    if bound is not None:
        suggestion = bound[1]
        if not fixed_by:
            why.append(bound[0])
    return error("OM401", STAGE,
                 "a dimension declared dynamic is specialised or constrained by the model: "
                 f"{_short_error(first)}" + (" " + " ".join(why) if why and not fixed_by
                                             else "") + "".join(
                     f" {d} is fixed to {n} by {at.file}:{at.line} in {at.function}"
                     + (f" (`{at.code}`)" if at.code else "") + f" [guard {g}]"
                     + (f", reached from {u.file}:{u.line}" if u and u != at else "")
                     + f": the ONNX file would only work at {d} = {n}."
                     for d, n, g, at, u in fixed_by)
                 + (f" {bound[0]}" if bound is not None and fixed_by else ""),
                 location=loc, suggestion=suggestion, details=details)


def classify_capture_error(results: list[Result]) -> Finding:
    """One finding for a failed capture: the most telling attempt, classified."""
    failed = [r for r in results if r.error is not None]
    first = failed[0].error if failed else RuntimeError("no capture strategy ran")
    texts = " \n".join(f"{type(r.error).__name__}: {r.error}" for r in failed)
    loc = None
    for r in failed:
        loc = location_from_exception(r.error)
        if loc is not None:
            break
    tried = "; ".join(r.summary()["error"] and f"{r.strategy}: {r.summary()['error']}"
                      for r in failed)
    details = {"attempts": [r.summary() for r in results]}
    packed = _packed_use_finding(failed, tried, loc, details)
    if packed is not None:
        return packed
    if _DYNAMIC.search(texts) and "Constraints violated" in texts:
        return _constrained_finding(failed, texts, first, loc, details)
    if _DATA_DEPENDENT.search(texts):
        where = f" at {loc.file}:{loc.line} (`{loc.code}`)" if loc and loc.code else ""
        guard = guard_line(failed)
        if guard is not None and (loc is None or (guard[0], guard[1]) != (loc.file, loc.line)):
            where += f", in the library at {guard[0]}:{guard[1]} (`{guard[2]}`)"
            details["guard"] = f"{guard[0]}:{guard[1]}"
        raised = raised_at(texts)
        if raised and loc is not None and raised.startswith(f"{loc.file}:{loc.line} "):
            raised = None  # the user's own line: already named
        if raised:
            details["raised_at"] = raised
            if guard is None:
                where += f", in a library's code at {raised}" if where else f" at {raised}"
        suggestion = _BRANCH_SUGGESTION
        loop = value_loop(failed) or adaptive_ode_solver(failed)
        if loop is not None:
            where += f", inside the loop at {loop[0]}:{loop[1]} (`{loop[2]}`)" if loop[
                2].startswith("while ") else f", in an adaptive solver at {loop[0]}:{loop[1]}"
            details["loop"] = f"{loop[0]}:{loop[1]}"
            suggestion = _loop_suggestion(loop, loc)
        return error("OM112", STAGE,
                     f"Python control flow depends on tensor values{where}; torch.export "
                     f"cannot trace it. Tried: {tried}", location=loc,
                     suggestion=suggestion, details=details)
    if _TYPES.search(texts):
        return error("OM113", STAGE,
                     f"forward() takes or returns a type torch.export cannot flatten. "
                     f"Tried: {tried}", location=loc,
                     suggestion="Return tensors, tuples, lists or dicts of tensors, or register "
                     "the class with torch.utils._pytree.register_pytree_node.",
                     details=details)
    return error("OM111", STAGE, f"torch.export could not capture the model. Tried: {tried}",
                 location=loc,
                 suggestion="Read the first failing line below; make forward() traceable "
                 "(no data-dependent Python control flow, no unsupported Python objects).",
                 details=details)
