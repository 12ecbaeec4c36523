"""Library caches keyed on tensor sizes, switched off for the capture.

Some libraries memoise work on the sizes of the tensors they get: tensorly's opt_einsum plugin
(``tensorly.plugins.use_opt_einsum``, which neuraloperator turns on when imported) builds a
contraction plan from the operands' shapes and caches it under a key made of them. Under dynamic
shapes the sizes are ``torch.SymInt``: planning with them fixes the declared dims to the
example's (or stops on a guard the plan cannot make), and a key made of them cannot be hashed.
The same computation is one switch away: the library's own documented way to bypass the cache
(``tensorly.plugins.use_default_einsum()``: the backend's plain einsum, the same contraction).
einx has no such switch (``EINX_CACHE_SIZE=0`` is read at import and drops only the cache: its
solver still takes integer sizes and its graph reshapes to them, ``torch.reshape(a, (2, 10,
1))``), so for its elementwise calls over plain axis names (``"b n, b n d, -> b n d"``)
onnxmedic computes the same thing itself: the torch op einx's graph calls, on each operand
moved to the output's axis order, with torch broadcasting (``einx_off``).

``SWITCHES`` is a table of such switches. ``capture`` (capture/strategies.py) turns one on when
an attempt failed in the cache's code (its file is on the failure's traceback or on the stack of
a guard that fixed a declared dim), tries that attempt again, and keeps the switch on for the
attempts after it; OM118 says which. Everything is put back when the capture ends, also when it
raises: the library's setting (``CachesOff``) and the contents of its caches (``stores``), which
an attempt could otherwise leave holding plans made of the trace's symbolic sizes.
Verification compares the ONNX model with the model as it is, cache on.

Every other call of such a library (``SIZE_BOUND``: einx's rearrange, reductions, brackets,
compositions) still fixes the declared dims it sees; OM401 then names the library's line, the
call into it and what to write instead.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)
_MISSING = object()


@dataclass(frozen=True)
class CacheSwitch:
    """A library's documented switch around a cache keyed on tensor sizes. ``module`` must
    already be imported (nothing is imported here); ``files``: path suffixes of the code that
    builds the key or the plan (a failure there implicates the cache); ``active(module)``:
    whether the cache is in use; ``off(module)`` bypasses it and returns an undo callable;
    ``stores(module)``: the cache's dicts, whose contents are put back after the capture."""

    library: str
    module: str
    files: tuple[str, ...]
    name: str  # the switch as the user writes it
    cache: str  # what is keyed on the sizes, for the finding
    active: Callable[[ModuleType], bool]
    off: Callable[[ModuleType], Callable[[], None]]
    stores: Callable[[ModuleType], list[dict[Any, Any]]] = lambda mod: []
    # the library's own documented switch; False: onnxmedic computes the same calls itself
    documented: bool = True


def _tensorly_active(plugins: ModuleType) -> bool:
    return plugins.PREVIOUS_EINSUM is not None


def _tensorly_off(plugins: ModuleType) -> Callable[[], None]:
    """``use_default_einsum()``; undo puts back the einsum it replaced (registered on the
    backend's class, see tensorly.backend.core.Backend.register_method) and PREVIOUS_EINSUM."""
    import tensorly as tl

    cls = type(tl.backend.current_backend())
    saved, previous = vars(cls).get("einsum", _MISSING), plugins.PREVIOUS_EINSUM
    plugins.use_default_einsum()

    def undo() -> None:
        if saved is _MISSING:
            if "einsum" in vars(cls):
                delattr(cls, "einsum")
        else:
            setattr(cls, "einsum", saved)
        plugins.PREVIOUS_EINSUM = previous
    return undo


# einx's elementwise ops and the torch function its torch backend calls for each
_EINX_ELEMENTWISE = {
    "where": "where", "add": "add", "subtract": "subtract", "multiply": "multiply",
    "divide": "divide", "true_divide": "true_divide", "floor_divide": "floor_divide",
    "maximum": "maximum", "minimum": "minimum", "less": "less", "less_equal": "less_equal",
    "greater": "greater", "greater_equal": "greater_equal", "equal": "eq",
    "not_equal": "not_equal", "logical_and": "logical_and", "logical_or": "logical_or",
}
_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def einx_plain(description: Any, operands: tuple[Any, ...]) -> tuple[list[list[str]], list[str]] | None:
    """(each operand's axis names, the output's) when an elementwise einx call is over plain
    axis names only - ``"b n, b n d, -> b n d"``: one name per dim of each tensor, an empty
    operand for a Python scalar, no brackets, compositions or ellipses, ``1`` only in the
    output, every output name taken from an input and every input name in the output (no
    reduction) -, else None (einx computes it)."""
    if not isinstance(description, str) or description.count("->") != 1:
        return None
    left, right = description.split("->")
    ins = [p.split() for p in left.split(",")]
    out = right.split()
    if len(ins) != len(operands) or len(set(out)) != len(out):
        return None
    for names, x in zip(ins, operands, strict=True):
        if not all(_AXIS.match(n) for n in names) or len(set(names)) != len(names):
            return None
        if isinstance(x, torch.Tensor):
            if x.dim() != len(names):
                return None
        elif names or not isinstance(x, (bool, int, float)):
            return None
    named = {n for names in ins for n in names}
    if not all(_AXIS.match(n) or n == "1" for n in out) or named != {n for n in out if n != "1"}:
        return None
    if not any(isinstance(x, torch.Tensor) for x in operands):
        return None
    return ins, out


def _to_output_axes(x: torch.Tensor, names: list[str], out: list[str]) -> torch.Tensor:
    """``x`` (axes ``names``) permuted to the output's order, with a dim of 1 for each output
    axis it lacks - what einx's graph does with reshapes of the example's sizes."""
    order = [n for n in out if n in names]
    x = x.permute([names.index(n) for n in order])
    for i, n in enumerate(out):
        if n not in names:
            x = x.unsqueeze(i)
    return x


def einx_off(einx: ModuleType) -> Callable[[], None]:
    """einx's elementwise calls over plain axis names (``einx_plain``) computed with torch
    broadcasting, the same torch op einx's graph calls, on tensors moved to the output's axis
    order; every other call, and every call outside the capture, goes to einx. Undo puts
    einx's functions back."""
    saved: dict[str, Any] = {}

    def plain(name: str, original: Any, fn: Any) -> Any:
        def call(description: Any, *operands: Any, **kwargs: Any) -> Any:
            arity = 3 if name == "where" else 2  # the torch op's (einx chains more)
            parsed = None if kwargs or len(operands) != arity else einx_plain(description,
                                                                                operands)
            if parsed is None:
                return original(description, *operands, **kwargs)
            ins, out = parsed
            device = next(x for x in operands if isinstance(x, torch.Tensor)).device
            # a Python scalar as einx's graph has it: a tensor of ones in every dim (which
            # takes part in dtype promotion as a dimensioned tensor)
            args = [_to_output_axes(x, names, out) if isinstance(x, torch.Tensor)
                    else torch.asarray(x, device=device).reshape([1] * len(out))
                    for x, names in zip(operands, ins, strict=True)]
            return fn(*args)
        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call

    for name, torch_name in _EINX_ELEMENTWISE.items():
        original = vars(einx).get(name)
        if original is not None and hasattr(torch, torch_name):
            saved[name] = original
            setattr(einx, name, plain(name, original, getattr(torch, torch_name)))

    def undo() -> None:
        for name, original in saved.items():
            setattr(einx, name, original)
    return undo


def _batched_nms_traceable(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor,
                           iou_threshold: float) -> torch.Tensor:
    """torchvision's batched_nms by its coordinate trick alone, without a branch on the box
    count: each class's boxes are moved by ``class * (max coordinate + 1)`` so that boxes of
    different classes never overlap, then one ``nms``. The max over no boxes is -inf (no
    offsets are made from it), where torchvision returns early."""
    top = torch.cat([boxes.reshape(-1), boxes.new_full((1,), float("-inf"))]).max()
    offsets = idxs.to(boxes) * (top + 1)
    return torch.ops.torchvision.nms(boxes + offsets[:, None], scores, iou_threshold)


def _torchvision_off(boxes: ModuleType) -> Callable[[], None]:
    """torchvision.ops.boxes.batched_nms picks the per-class loop or the coordinate trick by
    ``boxes.numel() > 4000``, a branch on a count that depends on the data (a guard no capture
    can make); both compute the same kept indices, and the trick is one ``nms`` node. Undo puts
    the function back (detection models call it as ``box_ops.batched_nms``)."""
    original = boxes.batched_nms
    boxes.batched_nms = _batched_nms_traceable
    ops = sys.modules.get("torchvision.ops")
    exported = ops is not None and getattr(ops, "batched_nms", None) is original
    if exported:
        ops.batched_nms = _batched_nms_traceable

    def undo() -> None:
        boxes.batched_nms = original
        if exported:
            ops.batched_nms = original
    return undo


SWITCHES: list[CacheSwitch] = [
    CacheSwitch(
        "tensorly", "tensorly.plugins", ("tensorly/plugins.py",),
        "tensorly.plugins.use_default_einsum()",
        "tensorly's opt_einsum plugin (use_opt_einsum, turned on by neuraloperator) plans each "
        "einsum from the operands' shapes and caches the plan under a key made of them",
        _tensorly_active, _tensorly_off,
        lambda plugins: [plugins.OPT_EINSUM_PATH_CACHE, plugins.CUQUANTUM_PATH_CACHE]),
    CacheSwitch(
        "einx", "einx", ("/einx/",),
        "einx's elementwise calls over plain axis names computed by onnxmedic with torch "
        "broadcasting (einx has no switch of its own)",
        "einx builds each call's graph from the sizes as Python ints and caches it under them",
        lambda einx: True, einx_off, documented=False),
    CacheSwitch(
        "torchvision", "torchvision.ops.boxes", ("torchvision/ops/boxes.py",),
        "torchvision.ops.batched_nms by its coordinate trick for every box count",
        "torchvision's batched_nms chooses its algorithm by the number of boxes, which a "
        "detection model's postprocess makes data dependent",
        lambda boxes: True, _torchvision_off, documented=False),
]


def applicable() -> list[tuple[CacheSwitch, ModuleType]]:
    """The switches of libraries the process has imported, with their modules."""
    return [(s, sys.modules[s.module]) for s in SWITCHES if s.module in sys.modules]


def _files(result: Any) -> list[str]:
    """The files of a failed attempt's traceback (every error of its chain) and of the stacks
    where guards fixed declared dims."""
    out: list[str] = []
    chain, e = [], result.error
    while e is not None and e not in chain:
        chain.append(e)
        out += [f.filename for f in traceback.extract_tb(e.__traceback__)]
        e = e.__cause__ or e.__context__
    for _guard, stack in (result.specialised or {}).values():
        out += [f.filename for f in stack]
    return [f.replace("\\", "/") for f in out]


@dataclass
class CachesOff:
    """The switches turned on during one capture (``on``: their names), undone by ``close``;
    the caches' contents when the capture began, put back by ``close`` as well."""

    on: list[str] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)
    _stores: list[tuple[dict[Any, Any], dict[Any, Any]]] = field(default_factory=list)
    _switched: list[CacheSwitch] = field(default_factory=list)

    def __enter__(self) -> CachesOff:
        for s, mod in applicable():
            try:
                self._stores += [(d, dict(d)) for d in s.stores(mod)]
            except Exception as e:  # a library version without that cache
                logger.debug("cache of %s not recorded: %s", s.name, e)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def implicated(self, result: Any) -> list[CacheSwitch]:
        """The switches not yet on whose cache is in use and whose code is among the failed
        attempt's files."""
        if result.error is None:
            return []
        files = _files(result)
        found = []
        for s, mod in applicable():
            if s in self._switched or not any(x in f for f in files for x in s.files):
                continue
            try:
                if s.active(mod):
                    found.append(s)
            except Exception as e:
                logger.debug("could not read %s: %s", s.name, e)
        return found

    def switch(self, switches: list[CacheSwitch]) -> bool:
        """Turn ``switches`` on; whether one was."""
        done = False
        for s in switches:
            try:
                self._undo.append(s.off(sys.modules[s.module]))
            except Exception as e:  # a library version without that switch
                logger.debug("switch %s not applied: %s", s.name, e)
                continue
            self._switched.append(s)
            self.on.append(s.name)
            done = True
        return done

    def described(self) -> list[tuple[str, str, str]]:
        """(library, switch, what the cache keys on the sizes) of each switch turned on."""
        return [(s.library, s.name, s.cache) for s in self._switched]

    def close(self) -> None:
        for u in reversed(self._undo):
            try:
                u()
            except Exception as e:
                logger.warning("could not restore a library cache setting: %s", e)
        self._undo.clear()
        for d, saved in self._stores:
            d.clear()
            d.update(saved)
        self._stores.clear()


@dataclass(frozen=True)
class SizeBound:
    """A library that computes with the sizes as Python ints by design, with no switch that
    keeps them symbolic: a declared dim it sees is fixed, whatever the capture does. ``files``:
    path fragments of its code; ``why``: how it fixes sizes; ``change``: what the user can
    change, with ``{call}`` for the call into the library."""

    library: str
    files: tuple[str, ...]
    why: str
    change: str


SIZE_BOUND: list[SizeBound] = [
    SizeBound(
        "einx", ("/einx/",),
        "einx builds each call's graph from the sizes as Python ints (its torch backend's "
        "get_shape, `int(x) for x in tensor.shape`; its expression solver takes integers "
        "only) and caches the graph under them; no einx setting keeps a size symbolic "
        "(EINX_CACHE_SIZE=0, read when einx is imported, drops the cache but not the ints), "
        "with the sizes kept symbolic the cache cannot hash them, and onnxmedic computes "
        "only einx's elementwise calls over plain axis names itself",
        "Write the einx call at {call} with torch ops (or einops, whose rearrange/reduce/"
        "repeat keep sizes symbolic) - e.g. `einx.where('b n, b n d, -> b n d', mask, x, 0.)`"
        " is `x.masked_fill(~mask[..., None], 0.)` and `einx.subtract('i, j -> i j', a, b)` "
        "is `a[:, None] - b[None, :]` -, or declare these dims static (dynamic_shapes: None "
        "for them; the file then accepts only the example's sizes)."),
]


@dataclass(frozen=True)
class BoundCall:
    """Where a size-bound library fixed a declared dim: the library, its line, and the call
    into it (the innermost frame outside it on the way there)."""

    bound: SizeBound
    at: Any  # traceback.FrameSummary in the library
    call: Any | None  # traceback.FrameSummary of the call into the library


def size_bound_calls(stacks: list[list[Any]], internal: Callable[[str], bool]
                     ) -> list[BoundCall]:
    """For each stack (innermost last) whose innermost frame outside torch (``internal``) is
    in a SIZE_BOUND library: that frame and the call into the library; one per call site."""
    out: list[BoundCall] = []
    for stack in stacks:
        frames = [f for f in stack if not internal(f.filename)]
        if not frames:
            continue
        at = frames[-1]
        path = at.filename.replace("\\", "/")
        bound = next((b for b in SIZE_BOUND if any(x in path for x in b.files)), None)
        if bound is None:
            continue
        call = None
        for f in reversed(frames):
            if not any(x in f.filename.replace("\\", "/") for x in bound.files):
                call = f
                break
        key = (call.filename, call.lineno) if call is not None else None
        if all(((c.call.filename, c.call.lineno) if c.call is not None else None) != key
               for c in out if c.bound is bound):
            out.append(BoundCall(bound, at, call))
    return out
