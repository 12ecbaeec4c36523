"""Library caches keyed on tensor sizes, switched off for the capture.

Some libraries memoise work on the sizes of the tensors they get: tensorly's opt_einsum plugin
(``tensorly.plugins.use_opt_einsum``, which neuraloperator turns on when imported) builds a
contraction plan from the operands' shapes and caches it under a key made of them. Under dynamic
shapes the sizes are ``torch.SymInt``: planning with them fixes the declared dims to the
example's (or stops on a guard the plan cannot make), and a key made of them cannot be hashed.
The same computation is one switch away: the library's own documented way to bypass the cache
(``tensorly.plugins.use_default_einsum()``: the backend's plain einsum, the same contraction).

``SWITCHES`` is a table of such switches. ``capture`` (capture/strategies.py) turns one on when
an attempt failed in the cache's code (its file is on the failure's traceback or on the stack of
a guard that fixed a declared dim), tries that attempt again, and keeps the switch on for the
attempts after it; OM118 says which. Everything is put back when the capture ends, also when it
raises: the library's setting (``CachesOff``) and the contents of its caches (``stores``), which
an attempt could otherwise leave holding plans made of the trace's symbolic sizes.
Verification compares the ONNX model with the model as it is, cache on.

Some libraries compute with the sizes as Python ints by design and have no such switch
(``SIZE_BOUND``: einx builds each call's graph from integer sizes and caches it under them).
No capture can keep a declared dim such a library sees dynamic; OM401 then names the library's
line, the call into it and what to write instead.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

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


SWITCHES: list[CacheSwitch] = [
    CacheSwitch(
        "tensorly", "tensorly.plugins", ("tensorly/plugins.py",),
        "tensorly.plugins.use_default_einsum()",
        "tensorly's opt_einsum plugin (use_opt_einsum, turned on by neuraloperator) plans each "
        "einsum from the operands' shapes and caches the plan under a key made of them",
        _tensorly_active, _tensorly_off,
        lambda plugins: [plugins.OPT_EINSUM_PATH_CACHE, plugins.CUQUANTUM_PATH_CACHE]),
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
            if s in self._switched or not any(f.endswith(x) for f in files for x in s.files):
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
        "and with the sizes kept symbolic the cache cannot hash them",
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
