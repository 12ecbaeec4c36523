"""Size rules: the sizes a dynamic dimension of the ONNX file is valid at, when not all are.

torch.export can follow code that only holds at some sizes - a UNet that pads odd sizes before
concatenating the skip connection, diffusers' ``if dim % 2**num_upsamplers`` - and record the
condition as a guard on the input size (``L['x'].size()[2] == 2*(L['x'].size()[2] // 2)``).
Declared with ``Dim.DYNAMIC`` the export then succeeds, but the ONNX file keeps no guard: it
fails in ONNX Runtime, or computes wrong numbers, at the other sizes.

A :class:`SizeRule` says which sizes the guards allow (a multiple of ``multiple``, at least
``minimum``). It is read statically from the program's guards (:func:`rules_from_guards`) with
the line that added the guard; verification then checks the file at sizes the rule allows as
well as the usual others, and the rule is *applied* - written into the file's metadata
(:data:`METADATA_KEY`) and reported as OM408 - only when a size the rule excludes failed and
every size it allows verified. A model that works at every size keeps no rule.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from onnxmedic.findings import Location
from onnxmedic.verify.input_sets import next_prime

logger = logging.getLogger(__name__)

# the model metadata_props key holding the applied rules, as JSON: {dim name: SizeRule dict}
METADATA_KEY = "onnxmedic.dim_constraints"


@dataclass(frozen=True)
class SizeRule:
    """The sizes a dynamic dim (ONNX dim name ``name``) is valid at: ``offset`` modulo
    ``multiple``, at least ``minimum``, at most ``maximum`` (None: no bound)."""

    name: str
    multiple: int = 1
    offset: int = 0
    minimum: int = 1
    maximum: int | None = None
    guard: str | None = None  # the guard that introduced it, as torch.export wrote it
    location: Location | None = None  # the line that added that guard

    def allows(self, n: int) -> bool:
        return (n >= self.minimum and (self.maximum is None or n <= self.maximum)
                and n % self.multiple == self.offset % self.multiple)

    def first(self) -> int:
        """The smallest size allowed."""
        n = self.minimum
        while not self.allows(n):
            n += 1
        return n

    def check_sizes(self, n: int) -> list[int]:
        """Sizes to verify a dim of example size ``n`` at, all allowed: the smallest, ``n``,
        the first from twice ``n`` up, and ``multiple`` times the first prime above ``n / multiple``
        (the offset added), so a file that needs a larger multiple still shows up."""
        k = self.multiple
        twice = 2 * n
        while not self.allows(twice) and (self.maximum is None or twice < self.maximum):
            twice += 1
        prime = next_prime(n // k) * k + self.offset % k
        out = {self.first(), n, twice, prime}
        return sorted(s for s in out if self.allows(s))

    def describe(self) -> str:
        """'a multiple of 2, at least 4' (the words for the finding and the file)."""
        parts = []
        if self.multiple > 1:
            parts.append(f"a multiple of {self.multiple}" if self.offset % self.multiple == 0
                         else f"{self.offset % self.multiple} more than a multiple of "
                         f"{self.multiple}")
        smallest = (self.offset % self.multiple or self.multiple) if self.multiple > 1 else 1
        if self.first() > smallest:
            parts.append(f"at least {self.first()}")
        if self.maximum is not None:
            parts.append(f"at most {self.maximum}")
        return ", ".join(parts) or "any size"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"multiple_of": self.multiple, "min": self.minimum,
                               "text": self.describe()}
        if self.offset % self.multiple:
            out["offset"] = self.offset % self.multiple
        if self.maximum is not None:
            out["max"] = self.maximum
        if self.location is not None and self.location.file:
            out["from"] = f"{self.location.file}:{self.location.line}"
        return out

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> SizeRule:
        return cls(name, multiple=max(1, int(d.get("multiple_of", 1))),
                   offset=int(d.get("offset", 0)), minimum=max(1, int(d.get("min", 1))),
                   maximum=int(d["max"]) if d.get("max") is not None else None)


# -- the file's metadata --------------------------------------------------------------------------
def rules_from_metadata(proto: Any) -> dict[str, SizeRule]:
    """The rules an ONNX file declares (written by :func:`metadata_entry`); {} when none."""
    for p in getattr(proto, "metadata_props", []):
        if p.key == METADATA_KEY:
            try:
                return {k: SizeRule.from_dict(k, v) for k, v in json.loads(p.value).items()}
            except (ValueError, TypeError, AttributeError):
                logger.debug("unreadable %s: %r", METADATA_KEY, p.value)
    return {}


def metadata_value(rules: dict[str, SizeRule]) -> str:
    return json.dumps({k: r.to_dict() for k, r in sorted(rules.items())}, sort_keys=True)


def append_metadata(path: Any, proto: Any, rules: dict[str, SizeRule]) -> None:
    """Record ``rules`` in the saved ONNX file at ``path`` (and in ``proto``), weights not
    written again (:func:`onnxmedic.onnxfile.append_metadata`)."""
    from onnxmedic.onnxfile import append_metadata as append

    append(path, METADATA_KEY, metadata_value(rules), proto)


# -- rules from the guards -----------------------------------------------------------------------
class _Sized:
    """A tensor's stand-in for evaluating guards: ``size()``, ``shape``, ``stride()``."""

    def __init__(self, shape: list[int]) -> None:
        self.shape = list(shape)

    def size(self, d: int | None = None) -> Any:
        return self.shape if d is None else self.shape[d]

    def stride(self, d: int | None = None) -> Any:
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= max(s, 1)
        out.reverse()
        return out if d is None else out[d]

    def storage_offset(self) -> int:
        return 0

    def dim(self) -> int:
        return len(self.shape)


def _stand_ins(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[int, tuple[_Sized, str]]] | None:
    """(``L`` as torch.export's guards name the inputs, leaf index -> (its stand-in, its
    source ``L['x']``)), the leaves those of ``(args, kwargs)``; None when the forward's
    signature does not bind them."""
    fn = getattr(model, "forward", None)
    if fn is None:
        return None
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    index = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
    by_leaf: dict[int, tuple[_Sized, str]] = {}

    def conv(v: Any, src: str) -> Any:
        if isinstance(v, torch.Tensor):
            s = _Sized(list(v.shape))
            if id(v) in index:
                by_leaf[index[id(v)]] = (s, src)
            return s
        if isinstance(v, (list, tuple)):
            return [conv(x, f"{src}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            return {k: conv(x, f"{src}[{k!r}]") for k, x in v.items()}
        return v

    env = {name: conv(v, f"L[{name!r}]") for name, v in bound.items()}
    for name, v in list(bound.items()):  # **kwargs: torch.export names them at the top too
        if isinstance(v, dict) and name not in kwargs:
            for k, x in v.items():
                env.setdefault(k, conv(x, f"L[{k!r}]"))
    return env, by_leaf


_GLOBALS = {"__builtins__": {}, "max": max, "min": min, "abs": abs, "int": int, "float": float,
            "math": math, "len": len}


def rules_from_guards(guards: list[str], model: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any], symbols: dict[str, tuple[int, list[Any]]],
                      locations: dict[str, list[tuple[str, Location]]] | None = None
                      ) -> dict[str, SizeRule]:
    """For each dynamic dim (``symbols``: ONNX dim name -> (example size, [(leaf index, dim)])
    - the leaves those of ``(args, kwargs)``), the sizes torch.export's ``guards`` allow with
    the other dims at the example's, when they are not all sizes and form a rule (an
    arithmetic progression from a minimum); ``locations`` (input dim -> [(guard, line)], from
    capture.strategies.guard_locations) names the line that added the telling guard. Guards
    that cannot be evaluated are left out."""
    made = _stand_ins(model, args, kwargs)
    if made is None or not guards:
        return {}
    env, by_leaf = made
    compiled: list[tuple[str, Any]] = []
    for g in guards:
        if ".size()" not in g:
            continue
        try:
            compiled.append((g, compile(g, "<guard>", "eval")))
        except SyntaxError:
            continue
    out: dict[str, SizeRule] = {}
    for name, (n, uses) in symbols.items():
        stands = [(by_leaf[li][0], d) for li, d in uses if li in by_leaf]
        srcs = [f"{by_leaf[li][1]}.size()[{d}]" for li, d in uses if li in by_leaf]
        # the guards on this dim (the others hold: the other dims stay at the example's)
        mine = [c for g, c in compiled if any(src in g for src in srcs)]
        if not stands or not mine:
            continue
        window = max(128, min(8 * n, max(1024, 2 * n)))
        allowed = [v for v in range(1, window + 1) if _holds(mine, env, stands, v, n)]
        rule = _progression(name, allowed, window, n)
        if rule is None:
            continue
        if locations:
            at = _telling(rule, [g for s in srcs for g in locations.get(s, [])])
            if at is not None:
                guard = re.sub(r"\b[su]\d+\b", name, at[0])  # the one symbol: the dim
                rule = SizeRule(rule.name, rule.multiple, rule.offset, rule.minimum,
                                rule.maximum, guard=guard, location=at[1])
        out[name] = rule
    return out


def _telling(rule: SizeRule, found: list[tuple[str, Location]]) -> tuple[str, Location] | None:
    """The guard that best explains ``rule``: one that makes the dim a multiple (an equality
    over ``//`` or Mod) for a multiple, one that bounds it (not ``!= 1``, which torch adds on
    its own) for a minimum."""
    divides = [g for g in found if "//" in g[0] or "Mod(" in g[0]]
    congruent = [g for g in divides if g[0].startswith("Eq(")]  # 2*(w//2) == w: w is even
    bounds = [g for g in found if any(w in g[0] for w in (">", "<"))]
    pick = (congruent or divides or bounds) if rule.multiple > 1 else (bounds or divides)
    return pick[0] if pick else None


def _holds(compiled: list[Any], env: dict[str, Any], stands: list[tuple[_Sized, int]],
           v: int, n: int) -> bool:
    for s, d in stands:
        s.shape[d] = v
    try:
        for c in compiled:
            try:
                if not eval(c, _GLOBALS, {"L": env}):  # noqa: S307 - torch.export's own guards
                    return False
            except Exception:  # a guard over something the stand-ins lack: not judged
                continue
        return True
    finally:
        for s, d in stands:
            s.shape[d] = n


def _progression(name: str, allowed: list[int], window: int, n: int) -> SizeRule | None:
    """The rule ``allowed`` (the sizes in 1..window the guards allow) follows, or None when it
    is every size, does not hold the example's, or is not a progression from a minimum."""
    if n not in allowed or len(allowed) == window:
        return None
    lo, hi = allowed[0], allowed[-1]
    k = 0
    for a in allowed:
        k = math.gcd(k, a - lo)
    k = k or 1
    if allowed != list(range(lo, hi + 1, k)):
        return None
    if len(allowed) < 3:  # the example's size (nearly) alone: a static dim, not a rule
        return None
    return SizeRule(name, multiple=k, offset=lo % k, minimum=lo,
                    maximum=None if hi > window - k else hi)
