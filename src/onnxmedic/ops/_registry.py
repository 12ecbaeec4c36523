"""The translation registry: ATen op overload -> ONNX Script translation.

Entries are keyed by the real op object (``torch.ops.aten.linalg_inv.default``), like torch.onnx's
``onnx_impl`` and onnxscript's ``torch_op``. The registry becomes torch.onnx's
``custom_translation_table``, so its entries win over torchlib's and keep torch's decompositions
from splitting the op before it is translated.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Modules holding onnxmedic's own translations, one per op family. Each is imported on first use;
# one that fails to import is reported (OM210) and the others still load.
BUILTIN_FAMILIES: tuple[str, ...] = (
    "onnxmedic.ops.special",
    "onnxmedic.ops.elementwise",
    "onnxmedic.ops.linalg",
    "onnxmedic.ops.selection",
    "onnxmedic.ops.cumulative",
    "onnxmedic.ops.indexing",
    "onnxmedic.ops.pooling",
    "onnxmedic.ops.distance",
    "onnxmedic.ops.miscompiles",
    "onnxmedic.ops.logical",
    "onnxmedic.ops.grouped",
    "onnxmedic.ops.complex",
    "onnxmedic.ops.rnn",
    "onnxmedic.ops.vision",
    "onnxmedic.ops.convolution",
)


class RegistrationError(TypeError):
    """A translation was registered with a key that is not an operator."""


@dataclass(frozen=True)
class TranslationMeta:
    """What the registry knows about one translation."""

    target: torch._ops.OpOverload
    function: Callable[..., Any]
    family: str
    source: str  # "builtin" or "user"
    static_shapes: bool = False  # needs some input sizes known at export time
    overrides_torchlib: bool = False  # replaces a torchlib translation that is wrong
    note: str = ""
    # for complex-valued inputs: torch.onnx passes a complex tensor as a real one with a
    # trailing dim of 2 (real, imag) and dispatches a node with a complex input only to
    # translations marked complex (torchlib's ``complex=True``)
    complex: bool = False

    @property
    def name(self) -> str:
        return f"{self.target} (complex)" if self.complex else str(self.target)

    @property
    def key(self) -> tuple[torch._ops.OpOverload, bool]:
        return (self.target, self.complex)


def canonical_name(name: str) -> str:
    """"ns::op" / "ns.op" / "ns::op.overload" as "ns.op.overload" (str() of the overload)."""
    parts = name.replace("::", ".").split(".")
    return ".".join(parts + ["default"] if len(parts) == 2 else parts)


def resolve_target(target: Any) -> torch._ops.OpOverload:
    """Turn a registration key into an OpOverload, or say exactly what is wrong with it."""
    if isinstance(target, torch._ops.OpOverload):
        return target
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = target.overloads()
        functional = [o for o in overloads if o != "out" and not o.endswith("_out")]
        if functional == ["default"]:  # out= variants never appear in exported programs
            return target.default
        raise RegistrationError(
            f"{target} has several overloads ({', '.join(overloads)}); register each one, e.g. "
            f"@translation({target}.{overloads[0]})"
        )
    if isinstance(target, str):
        name = target.replace("::", ".")
        parts = name.split(".")
        if len(parts) not in (2, 3):
            raise RegistrationError(
                f"cannot read {target!r} as an operator name; use 'namespace::op' or "
                f"'namespace::op.overload', e.g. 'mylib::my_op' or 'aten::add.Tensor'"
            )
        ns, opname = parts[0], parts[1]
        overload = parts[2] if len(parts) == 3 else "default"
        try:
            packet = getattr(getattr(torch.ops, ns), opname)
            return getattr(packet, overload)
        except (AttributeError, RuntimeError) as e:
            raise RegistrationError(
                f"no operator {ns}::{opname}.{overload} is defined; define it first (e.g. "
                f"with torch.library.custom_op) or check the spelling"
            ) from e
    hint = ""
    if callable(target) and getattr(target, "__module__", "").startswith("torch"):
        hint = " (a Python function like torch.linalg.inv is not an operator: use " \
               "torch.ops.aten.linalg_inv.default)"
    raise RegistrationError(
        f"a translation must be keyed by an operator overload such as "
        f"torch.ops.aten.linalg_inv.default or a name like 'aten::linalg_inv', not "
        f"{type(target).__name__} {target!r}{hint}"
    )


@dataclass
class TranslationRegistry:
    """All translations onnxmedic passes to torch.onnx. User registrations win over builtin."""

    # keyed by (op, complex): an op may have a real and a complex-valued translation
    _entries: dict[tuple[torch._ops.OpOverload, bool], TranslationMeta] = field(
        default_factory=dict)
    # entries for ops another library defines on import ("ns.op.overload" -> the entry's
    # fields but the target): registered as soon as the op exists
    _pending: dict[str, dict[str, Any]] = field(default_factory=dict)
    load_errors: dict[str, str] = field(default_factory=dict)
    _loaded: bool = False
    _cache: dict[Any, Any] = field(default_factory=dict)  # torch.onnx registries built from us

    def register(self, meta: TranslationMeta) -> None:
        old = self._entries.get(meta.key)
        if old is not None:
            if old.source == "user" and meta.source == "builtin":
                logger.debug("keeping user translation for %s", meta.name)
                return
            warnings.warn(
                f"onnxmedic: translation for {meta.name} registered twice "
                f"({old.function.__qualname__} then {meta.function.__qualname__}); the later wins",
                stacklevel=3,
            )
        self._entries[meta.key] = meta
        self._cache.clear()

    def unregister(self, target: Any) -> None:
        """Remove the translations of ``target`` (real and complex-valued, or pending)."""
        if isinstance(target, str) and canonical_name(target) in self._pending:
            del self._pending[canonical_name(target)]
            return
        resolved = resolve_target(target)
        for key in [(resolved, False), (resolved, True)]:
            self._entries.pop(key, None)
        self._cache.clear()

    def register_pending(self, name: str, fields: dict[str, Any]) -> None:
        """Keep an entry for an op that is not defined yet (a custom op of a library that
        defines it when imported, like transformers' ``transformers::grouped_mm_fallback``);
        it is registered the first time the registry is read after the op exists."""
        self._pending[canonical_name(name)] = fields
        self._resolve_pending()

    def _resolve_pending(self) -> None:
        for name in list(self._pending):
            try:
                target = resolve_target(name)
            except RegistrationError:
                continue  # not defined yet
            self.register(TranslationMeta(target=target, **self._pending.pop(name)))

    def pending(self) -> list[tuple[str, dict[str, Any]]]:
        """Entries waiting for their op to be defined: ("ns.op.overload", fields)."""
        self._resolve_pending()
        return sorted(self._pending.items())

    def load_builtin(self, families: Iterable[str] = BUILTIN_FAMILIES) -> None:
        """Import the family modules (each registers its entries). Failures are recorded."""
        if self._loaded:
            return
        self._loaded = True
        for mod in families:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as e:
                if e.name == mod:
                    continue  # family not written yet
                self.load_errors[mod] = f"{type(e).__name__}: {e}"
                logger.warning("onnxmedic: translations in %s failed to load: %s", mod, e)
            except Exception as e:  # one broken family never breaks the rest
                self.load_errors[mod] = f"{type(e).__name__}: {e}"
                logger.warning("onnxmedic: translations in %s failed to load: %s", mod, e)

    def entries(self) -> list[TranslationMeta]:
        self.load_builtin()
        self._resolve_pending()
        return sorted(self._entries.values(), key=lambda m: m.name)

    def get(self, target: Any, *, complex: bool = False) -> TranslationMeta | None:  # noqa: A002
        """The translation of ``target`` (its complex-valued one with ``complex=True``)."""
        self.load_builtin()
        self._resolve_pending()
        try:
            return self._entries.get((resolve_target(target), complex))
        except RegistrationError:
            return None

    def __contains__(self, target: Any) -> bool:
        return self.get(target) is not None

    def table(self) -> dict[torch._ops.OpOverload, Callable[..., Any]]:
        """The ``custom_translation_table`` for torch.onnx.export (real-valued entries: the
        table has no way to mark a complex-valued one; :meth:`onnx_registry` has all)."""
        return {m.target: m.function for m in self.entries() if not m.complex}

    def complex_table(self) -> dict[torch._ops.OpOverload, Callable[..., Any]]:
        """The complex-valued translations, by op."""
        return {m.target: m.function for m in self.entries() if m.complex}

    def onnx_registry(self, opset: int | None = None) -> Any:
        """torch.onnx's registry (torchlib plus our entries) for ``opset``, built once.

        Building it from torchlib takes about a second; torch.onnx.export rebuilds it on every
        call, onnxmedic keeps it until its own entries change.
        """
        from onnxmedic._torch_compat import torchlib_opset, torchlib_registry

        version = max(opset or torchlib_opset(), torchlib_opset())
        entries = self.entries()
        key = (version, tuple(sorted((m.name, id(m.function)) for m in entries)))
        reg = self._cache.get(key)
        if reg is None:
            reg = torchlib_registry(version)
            for m in entries:
                reg.register_op(m.target, m.function, is_complex=m.complex)
            self._cache.clear()
            self._cache[key] = reg
        return reg


REGISTRY = TranslationRegistry()


def translation(
    target: Any,
    *,
    static_shapes: bool = False,
    overrides_torchlib: bool = False,
    note: str = "",
    complex: bool = False,  # noqa: A002 - torchlib's own keyword
    registry: TranslationRegistry | None = None,
    defined_later: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register an ONNX Script translation for an ATen or custom operator.

    ``target`` is an operator overload (``torch.ops.aten.hypot.default``) or its name
    (``"aten::hypot"``, ``"mylib::my_op.default"``). The function is called by torch.onnx with
    the op's arguments as ONNX values (tensors) and Python values (ints, floats, lists), and
    returns ONNX values built with ``onnxscript.opset18`` ops::

        @onnxmedic.translation("mylib::scale")
        def scale(x, factor: float):
            return op.Mul(x, op.Constant(value_float=factor))

    With ``complex=True`` the translation is for calls with a complex-valued input, which
    torch.onnx passes as real tensors with a trailing dim of 2 (real, imag), like torchlib's
    ``complex=True`` functions; an op may have both a real and a complex-valued translation.

    Translations registered from outside onnxmedic are "user" entries and win over builtin ones.

    ``defined_later=True``: ``target`` is the name of an op that another library defines when
    it is imported (e.g. ``"transformers::grouped_mm_fallback"``); the entry waits until the op
    exists instead of being rejected, so registering it does not import that library.
    """
    reg = registry or REGISTRY
    resolved: torch._ops.OpOverload | None = None
    try:
        resolved = resolve_target(target)
    except RegistrationError:
        if not (defined_later and isinstance(target, str) and len(target.replace("::", ".")
                                                                   .split(".")) in (2, 3)):
            raise

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise RegistrationError(f"@translation({resolved}) must decorate a function")
        module = getattr(fn, "__module__", "") or ""
        source = "builtin" if module.startswith("onnxmedic.ops.") else "user"
        family = module.rsplit(".", 1)[-1] if source == "builtin" else "user"
        fields = {"function": fn, "family": family, "source": source,
                  "static_shapes": static_shapes, "overrides_torchlib": overrides_torchlib,
                  "note": note, "complex": complex}
        if resolved is None:
            reg.register_pending(target, fields)
        else:
            reg.register(TranslationMeta(target=resolved, **fields))
        return fn

    return decorator
