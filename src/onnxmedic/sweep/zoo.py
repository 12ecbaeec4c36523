"""Zoo loading: a zoo is a Python file, an importable module or a folder of such files, each
exposing ``ZOO``: a dict name -> factory returning a :class:`ZooCase` (or a tuple
``(model, args[, kwargs[, dynamic_shapes]])``)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.findings import InputError, error


@dataclass
class ZooCase:
    """What a zoo factory returns: the model, its example inputs and dynamic shapes.

    ``check``, when given, is called in the worker as ``check(onnx_path, case)`` after a
    verified export and returns a dict with ``ok`` (bool) and its figures - e.g. a comparison
    over a few greedy decoding steps. ``note`` is shown in the summary.
    """

    model: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    dynamic_shapes: Any = None
    note: str = ""
    check: Callable[[str, ZooCase], dict[str, Any]] | None = None
    tolerance: tuple[float, float] | None = None


def as_case(value: Any, name: str = "?") -> ZooCase:
    """Normalise what a factory returned into a ZooCase; TypeError when it is neither."""
    if isinstance(value, ZooCase):
        return value
    if isinstance(value, tuple) and 2 <= len(value) <= 4:
        model, args, *rest = value
        kwargs = rest[0] if rest else {}
        dyn = rest[1] if len(rest) > 1 else None
        if isinstance(args, list):
            args = tuple(args)
        elif not isinstance(args, tuple):
            args = (args,)
        return ZooCase(model, args, kwargs or {}, dyn)
    raise TypeError(f"zoo entry {name!r}: the factory returned {type(value).__name__}; it must "
                    "return a ZooCase or a tuple (model, args[, kwargs[, dynamic_shapes]])")


@dataclass(frozen=True)
class Entry:
    """One zoo entry: its name and where the worker imports it from (``source:attr``)."""

    name: str
    source: str
    attr: str = "ZOO"


def zoo_error(message: str, suggestion: str | None = None) -> InputError:
    return InputError(error("OM704", "zoo", message, suggestion=suggestion or
                            "A zoo is a .py file, an importable module or a folder of .py "
                            "files, each defining ZOO = {name: factory}."))


def import_source(source: str) -> Any:
    """Import a zoo source: a .py path or a dotted module name."""
    if source.endswith(".py") or os.sep in source:
        from onnxmedic.inputs import import_file

        return import_file(source)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(source)


def _zoo_dict(source: str, attr: str) -> dict[str, Any]:
    try:
        mod = import_source(source)
    except InputError:
        raise
    except Exception as e:
        raise zoo_error(f"cannot import the zoo {source!r}: {type(e).__name__}: {e}") from e
    zoo = getattr(mod, attr, None)
    if not isinstance(zoo, dict):
        raise zoo_error(f"{source!r} has no dict named {attr} "
                       f"({'it is a ' + type(zoo).__name__ if zoo is not None else 'missing'}).")
    return zoo


def load_zoo(spec: str | os.PathLike[str]) -> list[Entry]:
    """The entries of a zoo spec: ``file.py``, ``pkg.module``, either with ``:ATTR`` (default
    ``ZOO``), or a folder (every ``*.py`` not starting with ``_``). Raises InputError (OM704)."""
    spec = str(spec)
    path_part, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "ZOO")
    attr = attr or "ZOO"
    p = Path(path_part)
    if p.is_dir():
        sources = sorted(str(f) for f in p.glob("*.py") if not f.name.startswith("_"))
        if not sources:
            raise zoo_error(f"the folder {path_part!r} holds no .py zoo files.")
    elif path_part.endswith(".py") and not p.is_file():
        raise zoo_error(f"the zoo file {path_part!r} does not exist.")
    else:
        sources = [str(p.resolve()) if p.is_file() else path_part]
    entries: dict[str, Entry] = {}
    for src in sources:
        zoo = _zoo_dict(src, attr)
        for name, factory in zoo.items():
            if not callable(factory):
                raise zoo_error(f"zoo entry {name!r} in {src} is a {type(factory).__name__}, "
                               "not a factory (a function returning the model and inputs).")
            if name in entries:
                raise zoo_error(f"zoo entry {name!r} is defined twice ({entries[name].source} "
                               f"and {src}).")
            entries[str(name)] = Entry(str(name), src, attr)
    if not entries:
        raise zoo_error(f"the zoo {spec!r} has no entries ({attr} is empty).")
    return list(entries.values())
