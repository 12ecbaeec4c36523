"""Pytree registration of output (and input) types torch.export cannot flatten.

Hugging Face models return cache objects (``DynamicCache``, ``EncoderDecoderCache``, ...) in
their outputs; torch.export fails on them with "Found <class ...> in output, which is not a
known type". This step finds those classes - named in the error, or met among the example
inputs - and registers them with ``torch.utils._pytree``: with transformers' own
``register_pytree_node`` where the installed transformers has one (5.x), otherwise with a
generic flatten that takes every tensor reachable through the object's attributes and keeps
everything else in the pytree context. The capture strategy that uses it reports an OM120
finding naming the classes.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import Any

import torch
import torch.utils._pytree as pytree

logger = logging.getLogger(__name__)

_UNKNOWN_TYPE = re.compile(r"Found <class '([\w.]+)'> in (?:output|input)|"
                           r"<class '([\w.]+)'>.{0,80}not a known type|"
                           r"is not a supported (?:input|output) type.{0,40}<class '([\w.]+)'>",
                           re.IGNORECASE | re.DOTALL)
_PRIMITIVE = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype,
              torch.device, torch.Size)


def unknown_type_names(error: BaseException | str | None) -> list[str]:
    """Dotted class names that a torch.export error says it cannot flatten."""
    if error is None:
        return []
    text = str(error)
    names = []
    for m in _UNKNOWN_TYPE.finditer(text):
        name = next(g for g in m.groups() if g)
        if name not in names:
            names.append(name)
    return names


def _resolve(dotted: str) -> type | None:
    module, _, name = dotted.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except Exception:
        return None
    return obj if isinstance(obj, type) else None


def is_registered(cls: type) -> bool:
    return cls in pytree.SUPPORTED_NODES


def _needs_node(v: Any) -> bool:
    return (not isinstance(v, _PRIMITIVE) and not is_registered(type(v))
            and not isinstance(v, (list, tuple, dict, torch.nn.Module, type))
            and hasattr(v, "__dict__") and not callable(v))


def unknown_types_in(value: Any, limit: int = 10_000) -> list[type]:
    """Classes without a pytree registration met inside ``value`` (e.g. cache objects among
    the example inputs), including those inside their attributes."""
    found: list[type] = []
    seen: set[int] = set()
    stack = [value]
    while stack and len(seen) < limit:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif _needs_node(v):
            if type(v) not in found:
                found.append(type(v))
            stack.extend(vars(v).values())
        elif is_registered(type(v)) and not isinstance(v, (list, tuple, dict)):
            try:
                stack.extend(pytree.tree_flatten(v)[0])
            except Exception:
                logger.debug("cannot flatten %s", type(v), exc_info=True)
    return found


# --- generic flatten: tensors are leaves, everything else lives in the context -------------


def _to_ctx(v: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return ("t",)
    if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
        return ("seq", type(v), tuple(_to_ctx(x, tensors) for x in v))
    if isinstance(v, dict) and type(v) is dict:
        return ("map", tuple((k, _to_ctx(x, tensors)) for k, x in v.items()))
    if _needs_node(v) or (hasattr(v, "__dict__") and not isinstance(v, _PRIMITIVE)
                          and not callable(v) and not isinstance(v, torch.nn.Module)):
        return ("obj", type(v), tuple((k, _to_ctx(x, tensors)) for k, x in vars(v).items()))
    return ("const", v)


def _from_ctx(ctx: Any, tensors: list[Any]) -> Any:
    tag = ctx[0]
    if tag == "t":
        return tensors.pop(0)
    if tag == "seq":
        return ctx[1](_from_ctx(c, tensors) for c in ctx[2])
    if tag == "map":
        return {k: _from_ctx(c, tensors) for k, c in ctx[1]}
    if tag == "obj":
        obj = ctx[1].__new__(ctx[1])
        obj.__dict__.update({k: _from_ctx(c, tensors) for k, c in ctx[2]})
        return obj
    return ctx[1]


def _flatten(obj: Any) -> tuple[list[torch.Tensor], Any]:
    tensors: list[torch.Tensor] = []
    return tensors, _to_ctx(obj, tensors)


def _unflatten(values: Any, context: Any) -> Any:
    return _from_ctx(context, list(values))


def _flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
    leaves, ctx = _flatten(obj)
    return [(pytree.SequenceKey(i), leaf) for i, leaf in enumerate(leaves)], ctx


def register(cls: type) -> str:
    """Register ``cls`` as a pytree node; returns how ("transformers" or "generic")."""
    if cls.__module__.startswith("transformers."):
        try:
            from transformers.exporters.exporter_dynamo import register_pytree_node
        except ImportError:
            register_pytree_node = None
        if register_pytree_node is not None:
            register_pytree_node(cls)
            if is_registered(cls):
                return "transformers"
    pytree.register_pytree_node(cls, _flatten, _unflatten,
                                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                                flatten_with_keys_fn=_flatten_with_keys)
    return "generic"


def register_unknown_types(error: BaseException | None, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Register the classes a capture error names and those met among the inputs.

    Returns ({dotted class name: how registered}, [problems]). Classes already registered are
    left alone."""
    classes: list[type] = []
    problems: list[str] = []
    for name in unknown_type_names(error):
        cls = _resolve(name)
        if cls is None:
            problems.append(f"cannot import {name}")
        elif cls not in classes:
            classes.append(cls)
    for cls in unknown_types_in((args, kwargs)):
        if cls not in classes:
            classes.append(cls)
    done: dict[str, str] = {}
    for cls in classes:
        if is_registered(cls):
            continue
        dotted = f"{cls.__module__}.{cls.__qualname__}"
        try:
            done[dotted] = register(cls)
        except Exception as e:  # one class that will not register must not stop the others
            problems.append(f"{dotted}: {type(e).__name__}: {e}")
    return done, problems
