"""Model and input specs: turn command-line strings into an nn.Module and example inputs.

Model specs: ``path/file.py:attr``, ``pkg.module:attr`` (attr: an nn.Module instance, a class with
a no-argument constructor, or a factory function), and ``.pt2`` files (torch.export.save).
Input specs: shapes ``2x3x224x224:float32`` (seeded random data), ``file.py:make_inputs`` (a
function returning args or (args, kwargs)), ``.npz`` and ``.pt`` (loaded with weights_only=True).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onnxmedic.findings import InputError, error

STAGE = "inputs"
DEFAULT_SEED = 0

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "f32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "f16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64, "f64": torch.float64,
    "int64": torch.int64, "long": torch.int64, "i64": torch.int64,
    "int32": torch.int32, "int": torch.int32, "i32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}

_SHAPE_RE = re.compile(r"^(?:(?:\d+)(?:x\d+)*|scalar)(?::([A-Za-z0-9]+))?(?:@(-?[\d.e+-]+),(-?[\d.e+-]+))?$")


@dataclass
class ModelSource:
    """What a model spec resolved to, for reports and repro scripts."""

    spec: str
    kind: str  # "file", "module", "pt2", "object"
    file: str | None = None
    attr: str | None = None


@dataclass
class Inputs:
    """Example inputs for forward(): positional args and keyword args."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    specs: list[str] = field(default_factory=list)


def _err(code: str, message: str, suggestion: str | None = None) -> InputError:
    return InputError(error(code, STAGE, message, suggestion=suggestion))


def _split_spec(spec: str) -> tuple[str, str | None]:
    """Split 'target:attr'; a Windows drive colon or a missing attr leave attr None."""
    if ":" not in spec:
        return spec, None
    target, attr = spec.rsplit(":", 1)
    if not attr or not attr.replace(".", "").replace("_", "a").isalnum():
        return spec, None
    return target, attr


def import_file(path: str | os.PathLike[str]) -> Any:
    """Import a Python file as a module under a private name (its folder on sys.path)."""
    p = Path(path).resolve()
    if not p.is_file():
        raise _err("OM001", f"model file {str(path)!r} does not exist.",
                   "Check the path; model specs look like path/to/model.py:ClassName.")
    name = f"_onnxmedic_user_{abs(hash(str(p)))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise _err("OM002", f"cannot import {str(path)!r} as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(p.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        sys.modules.pop(name, None)
        raise _err("OM002", f"importing {str(path)!r} called sys.exit({e.code}).",
                   "Guard script code with `if __name__ == '__main__':`.") from e
    except Exception as e:
        sys.modules.pop(name, None)
        raise _err("OM002", f"importing {str(path)!r} raised {type(e).__name__}: {e}",
                   "Fix the error in the file; it must import cleanly.") from e
    return module


def _import_target(target: str) -> tuple[Any, str]:
    if target.endswith(".py") or os.sep in target or "/" in target:
        return import_file(target), "file"
    try:
        return importlib.import_module(target), "module"
    except ModuleNotFoundError as e:
        if Path(target).exists():
            return import_file(target), "file"
        raise _err("OM002", f"no Python module named {target!r} can be imported ({e}).",
                   "Use pkg.module:attr for an installed module or path/file.py:attr "
                   "for a file.") from e
    except Exception as e:
        raise _err("OM002", f"importing module {target!r} raised {type(e).__name__}: {e}") from e


def _get_attr(module: Any, attr: str, where: str) -> Any:
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            models = [n for n in names if _looks_like_model(getattr(module, n, None))]
            hint = f" Models found there: {', '.join(models[:10])}." if models else ""
            raise _err("OM002", f"{where} has no attribute {attr!r}.{hint}",
                       f"Name one of the module's attributes after the colon, e.g. "
                       f"{where}:{models[0] if models else 'MyModel'}.")
        obj = getattr(obj, part)
    return obj


def _looks_like_model(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) or (
        inspect.isclass(obj) and issubclass(obj, torch.nn.Module)
    )


def _instantiate(obj: Any, spec: str) -> torch.nn.Module | torch.export.ExportedProgram:
    if isinstance(obj, (torch.nn.Module, torch.export.ExportedProgram)):
        return obj
    if inspect.isclass(obj):
        if not issubclass(obj, torch.nn.Module):
            raise _err("OM003", f"{spec} is the class {obj.__name__}, not an nn.Module subclass.")
        try:
            return obj()
        except TypeError as e:
            raise _err("OM003", f"{spec}: the class {obj.__name__} cannot be built with no "
                       f"arguments ({e}).",
                       "Point the spec at an instance or at a factory function that builds "
                       "the model with its arguments.") from e
        except Exception as e:
            raise _err("OM100", f"{spec}: constructing {obj.__name__}() raised "
                       f"{type(e).__name__}: {e}") from e
    if callable(obj):
        try:
            made = obj()
        except TypeError as e:
            raise _err("OM003", f"{spec}: the factory {getattr(obj, '__name__', obj)} cannot "
                       f"be called with no arguments ({e}).") from e
        except Exception as e:
            raise _err("OM100", f"{spec}: the factory raised {type(e).__name__}: {e}") from e
        if isinstance(made, (torch.nn.Module, torch.export.ExportedProgram)):
            return made
        raise _err("OM003", f"{spec}: the factory returned {type(made).__name__}, "
                   f"not an nn.Module.")
    raise _err("OM003", f"{spec} is a {type(obj).__name__}, not a model.",
               "Name an nn.Module instance, an nn.Module class with a no-argument "
               "constructor, or a function returning a module.")


class UnsafePickleError(RuntimeError):
    """A .pt2 archive asked for an unrestricted unpickle; it was refused."""


@contextlib.contextmanager
def _weights_only_unpickling() -> Iterator[None]:
    """Make torch.export.load safe: torch 2.13's PT2 reader unpickles tensor-subclass weights
    and constants with ``torch.load(weights_only=False)``, opaque objects with ``pickle.loads``
    and torchbind objects with ``torch._C._pickle_load_obj`` -- any of which runs code from the
    file. Inside this context torch.load is forced to ``weights_only=True`` and the other two
    refuse. Not thread-safe (it swaps module attributes); loads are serialised by a lock."""
    from torch.export.pt2_archive import _package

    orig_load, orig_obj, orig_pickle = torch.load, torch._C._pickle_load_obj, _package.pickle

    def load(f: Any, *a: Any, weights_only: Any = None, **k: Any) -> Any:
        try:
            return orig_load(f, *a, weights_only=True, **k)
        except Exception as e:
            if "weights_only" in str(e) or "Unsupported global" in str(e):
                raise UnsafePickleError("a weight or constant is not a plain tensor pickle") from e
            raise

    def refuse(*a: Any, **k: Any) -> Any:
        raise UnsafePickleError("an opaque or torchbind object would be unpickled")

    class _NoPickle:
        loads = load_obj = staticmethod(refuse)

        def __getattr__(self, name: str) -> Any:
            return getattr(orig_pickle, name)

    with _PT2_LOCK:
        torch.load, torch._C._pickle_load_obj, _package.pickle = load, refuse, _NoPickle()
        try:
            yield
        finally:
            torch.load, torch._C._pickle_load_obj, _package.pickle = (
                orig_load, orig_obj, orig_pickle)


_PT2_LOCK = threading.Lock()


def safe_export_load(path: str | os.PathLike[str]) -> torch.export.ExportedProgram:
    """``torch.export.load`` with every unpickle restricted to plain tensors (see above)."""
    with _weights_only_unpickling():
        return torch.export.load(path)


def load_model(spec: str) -> tuple[torch.nn.Module | torch.export.ExportedProgram, ModelSource]:
    """Resolve a model spec (see module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise _err("OM004", f"empty model spec {spec!r}.",
                   "Use path/file.py:Attr, pkg.module:Attr or model.pt2.")
    spec = spec.strip()
    if spec.endswith(".pt2"):
        if not Path(spec).is_file():
            raise _err("OM001", f"model file {spec!r} does not exist.")
        try:
            ep = safe_export_load(spec)
        except UnsafePickleError as e:
            raise _err("OM003", f"{spec!r} holds a pickle that torch.export.load would unpickle "
                       f"with code execution allowed ({e}); onnxmedic refused it and ran "
                       "nothing from it.",
                       "Only load .pt2 files from sources you trust; re-save the program with "
                       "plain tensors (no tensor subclasses or opaque objects).") from e
        except Exception as e:
            raise _err("OM003", f"{spec!r} is not a loadable torch.export program "
                       f"({type(e).__name__}: {str(e)[:300]}).",
                       "Save programs with torch.export.save(ep, 'model.pt2').") from e
        return ep, ModelSource(spec, "pt2", file=spec)
    target, attr = _split_spec(spec)
    if attr is None:
        if target.endswith(".py"):
            raise _err("OM004", f"model spec {spec!r} names a file but no attribute.",
                       f"Add the model's name after a colon: {spec}:MyModel.")
        raise _err("OM004", f"cannot read model spec {spec!r}.",
                   "Use path/file.py:Attr, pkg.module:Attr or model.pt2.")
    module, kind = _import_target(target)
    obj = _get_attr(module, attr, target)
    model = _instantiate(obj, spec)
    return model, ModelSource(spec, kind, file=getattr(module, "__file__", None), attr=attr)


# ---------------------------------------------------------------------------------------------
# inputs


def parse_shape_spec(spec: str) -> tuple[tuple[int, ...], torch.dtype, tuple[float, float] | None]:
    """'2x3x224x224:float32' -> ((2,3,224,224), float32, None); '4x4:float32@-1,1' sets a range.

    'scalar:int64' is a 0-d tensor. Raises InputError (OM004) with the accepted forms.
    """
    m = _SHAPE_RE.match(spec.strip())
    if not m:
        raise _err("OM004", f"cannot read input spec {spec!r}.",
                   "Input specs: a shape like 2x3x224x224:float32 (dtype optional, default "
                   "float32; add @LOW,HIGH for a value range), file.py:make_inputs, "
                   "inputs.npz or inputs.pt.")
    shape_part = spec.strip().split(":", 1)[0].split("@", 1)[0]
    shape = () if shape_part == "scalar" else tuple(int(d) for d in shape_part.split("x"))
    dtype_name = (m.group(1) or "float32").lower()
    if dtype_name not in DTYPES:
        raise _err("OM004", f"unknown dtype {dtype_name!r} in input spec {spec!r}.",
                   f"Known dtypes: {', '.join(sorted(set(DTYPES)))}.")
    rng = None
    if m.group(2) is not None:
        lo, hi = float(m.group(2)), float(m.group(3))
        if not lo < hi:
            raise _err("OM004", f"value range {lo},{hi} in {spec!r} is empty.")
        rng = (lo, hi)
    numel = 1
    for d in shape:
        numel *= d
    if numel > 2**31:
        raise _err("OM004", f"input spec {spec!r} asks for {numel} elements; that is too large "
                   f"for an example input.")
    return shape, DTYPES[dtype_name], rng


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator,
                  value_range: tuple[float, float] | None = None) -> torch.Tensor:
    """Seeded example data: normal floats (or uniform in a range), small non-negative ints."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        if value_range is not None:
            lo, hi = value_range
            return (torch.rand(shape, generator=generator, dtype=torch.float64) * (hi - lo)
                    + lo).to(dtype)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    lo, hi = (int(value_range[0]), int(value_range[1])) if value_range else (0, 10)
    return torch.randint(lo, hi, shape, generator=generator, dtype=torch.int64).to(dtype)


def _as_args_kwargs(value: Any, where: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Normalise what make_inputs returned: a tensor, a tuple of args, (args, kwargs) or a dict."""
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
        if (len(value) == 2 and isinstance(value[0], (tuple, list))
                and isinstance(value[1], dict)):
            return tuple(value[0]), dict(value[1])
        return value, {}
    raise _err("OM005", f"{where} returned {type(value).__name__}; expected a tensor, a tuple "
               f"of arguments, a dict of keyword arguments or (args, kwargs).")


def as_input_set(value: Any, where: str) -> Inputs:
    """One input set from a tensor, a tuple of args, a dict of keyword args or (args, kwargs)
    (OM005 for anything else; ``where`` names it in the message)."""
    return Inputs(*_as_args_kwargs(value, where))


def _load_npz(path: Path) -> tuple[tuple[Any, ...], dict[str, Any]]:
    try:
        with np.load(path, allow_pickle=False) as data:
            items = [(k, data[k]) for k in data.files]
    except Exception as e:
        raise _err("OM005", f"cannot read {str(path)!r} as .npz ({type(e).__name__}: {e}).",
                   "Save inputs with numpy.savez('inputs.npz', x=..., mask=...); object "
                   "arrays are refused.") from e
    if all(re.fullmatch(r"arr_\d+", k) for k, _ in items):
        items.sort(key=lambda kv: int(kv[0][4:]))
        return tuple(torch.from_numpy(np.array(v)) for _, v in items), {}
    return (), {k: torch.from_numpy(np.array(v)) for k, v in items}


def _load_pt(path: Path) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return _as_args_kwargs(_torch_load(path), str(path))


def _torch_load(path: Path) -> Any:
    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        unsafe = "weights_only" in str(e) or "Unsupported global" in str(e)
        msg = (f"{str(path)!r} holds Python objects that are not plain tensors; it was refused "
               f"without running any of its code." if unsafe
               else f"cannot read {str(path)!r} as a torch file ({type(e).__name__}).")
        raise _err("OM005", msg, "Save inputs as tensors only: torch.save((x, y), 'in.pt') or "
                   "torch.save({'x': x}, 'in.pt').") from e
    return value


def _call_spec(spec: str, example: str) -> Any:
    """What the function named by ``file.py:fn`` or ``pkg.module:fn`` returns."""
    target, attr = _split_spec(spec)
    if attr is None:
        raise _err("OM004", f"cannot read input spec {spec!r}.",
                   f"Use file.py:{example} or pkg.module:{example}.")
    module, _ = _import_target(target)
    fn = _get_attr(module, attr, target)
    if not callable(fn):
        raise _err("OM005", f"{spec} is not a function.")
    try:
        return fn()
    except Exception as e:
        raise _err("OM005", f"{spec} raised {type(e).__name__}: {e}") from e


_CALIBRATION_FORMS = ("a .pt file holding a list of input sets (torch.save([x1, x2, ...]) or "
                      "[(x, mask), ...]), an .npz whose arrays stack the sets on a first axis "
                      "(numpy.savez('cal.npz', x=np.stack(xs))), or file.py:fn returning a "
                      "list of input sets")


def load_calibration(spec: str) -> list[Inputs]:
    """Static int8's calibration input sets (``--calibration``): each set is what an
    ``--input`` file holds (a tensor, a tuple of args, a dict of keyword args or (args,
    kwargs)). ``spec``: a .pt file holding a list of sets, an .npz whose arrays (positional
    ``arr_0 ...`` or named like the inputs) have the sets stacked on a first axis, or
    ``file.py:fn`` / ``pkg.module:fn`` returning an iterable of sets."""
    if not isinstance(spec, str) or not spec.strip():
        raise _err("OM004", f"empty calibration spec {spec!r}.", f"Give {_CALIBRATION_FORMS}.")
    spec = spec.strip()
    low = spec.lower()
    if low.endswith((".npz", ".pt", ".pth")):
        if not Path(spec).is_file():
            raise _err("OM005", f"calibration file {spec!r} does not exist.")
        if low.endswith(".npz"):
            args, kwargs = _load_npz(Path(spec))
            return _unstack(spec, args, kwargs)
        value = _torch_load(Path(spec))
    elif ":" in spec:
        value = _call_spec(spec, "calibration_sets")
    else:
        raise _err("OM004", f"cannot read calibration spec {spec!r}.",
                   f"Give {_CALIBRATION_FORMS}.")
    if not isinstance(value, (list, Iterator)):  # a tuple or dict is one set's arguments
        raise _err("OM005", f"{spec} holds {type(value).__name__}, not a list of input sets.",
                   f"Give {_CALIBRATION_FORMS}.")
    sets = [as_input_set(v, f"{spec} set {i}") for i, v in enumerate(value)]
    if not sets:
        raise _err("OM005", f"{spec} holds no input sets.", f"Give {_CALIBRATION_FORMS}.")
    return sets


def _unstack(spec: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Inputs]:
    """The sets an .npz stacks on the first axis of every array (all of one length)."""
    arrays = [*args, *kwargs.values()]
    counts = {int(a.shape[0]) if a.ndim else -1 for a in arrays}
    if len(counts) != 1 or min(counts) < 1:
        raise _err("OM005", f"{spec}: the calibration arrays must stack the sets on their first "
                   f"axis, each with as many sets (first dims: "
                   f"{[int(a.shape[0]) if a.ndim else 'scalar' for a in arrays]}).",
                   f"Give {_CALIBRATION_FORMS}.")
    return [Inputs(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()})
            for i in range(counts.pop())]


def load_inputs(specs: list[str] | tuple[str, ...], *, seed: int = DEFAULT_SEED) -> Inputs:
    """Resolve ``--input`` specs, in order, into forward()'s args and kwargs."""
    gen = torch.Generator().manual_seed(seed)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise _err("OM004", f"empty input spec {spec!r}.")
        spec = spec.strip()
        low = spec.lower()
        if low.endswith(".npz") or low.endswith(".pt") or low.endswith(".pth"):
            path = Path(spec)
            if not path.is_file():
                raise _err("OM005", f"input file {spec!r} does not exist.")
            a, k = _load_npz(path) if low.endswith(".npz") else _load_pt(path)
        elif _SHAPE_RE.match(spec) or re.match(r"^[\dx]+[:@]", spec):
            shape, dtype, rng = parse_shape_spec(spec)
            a, k = (random_tensor(shape, dtype, gen, rng),), {}
        elif ":" in spec:
            a, k = _as_args_kwargs(_call_spec(spec, "make_inputs"), spec)
        else:
            parse_shape_spec(spec)  # raises the OM004 message listing the accepted forms
            raise AssertionError("unreachable")
        args.extend(a)
        overlap = set(kwargs) & set(k)
        if overlap:
            raise _err("OM004", f"keyword inputs given twice: {', '.join(sorted(overlap))}.")
        kwargs.update(k)
    return Inputs(tuple(args), kwargs, list(specs))


# ---------------------------------------------------------------------------------------------
# dynamic shapes

_DYN_RE = re.compile(r"^([A-Za-z_][\w.]*):((?:\d+=[A-Za-z_]\w*)(?:,\d+=[A-Za-z_]\w*)*)$")


AUTO = "auto"


def parse_dynamic_specs(specs: list[str] | tuple[str, ...]) -> dict[str, dict[int, str]] | str:
    """['x:0=batch,2=h', 'mask:0=batch'] -> {'x': {0: 'batch', 2: 'h'}, 'mask': {0: 'batch'}}.

    Also ``auto`` (every dim of every input dynamic where the model allows it) and the old
    torch.onnx ``dynamic_axes`` dict, e.g. ``{'x': [0, 1]}`` or ``{'x': {0: 'batch'}}``."""
    if [s.strip() for s in specs] == [AUTO]:
        return AUTO
    out: dict[str, dict[int, str]] = {}
    for spec in specs:
        if spec.strip().startswith("{"):
            for name, dims in dynamic_axes_to_specs(_literal(spec)).items():
                out.setdefault(name, {}).update(dims)
            continue
        m = _DYN_RE.match(spec.strip())
        if not m:
            raise _err("OM004", f"cannot read dynamic-shape spec {spec!r}.",
                       "Use INPUT:DIM=NAME[,DIM=NAME...], e.g. --dynamic x:0=batch,2=height "
                       "(INPUT is forward()'s parameter name).")
        dims = out.setdefault(m.group(1), {})
        for part in m.group(2).split(","):
            d, name = part.split("=")
            dims[int(d)] = name
    return out


def _literal(spec: str) -> Any:
    import ast

    try:
        return ast.literal_eval(spec.strip())  # literals only: nothing is evaluated
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise _err("OM004", f"cannot read dynamic_axes dict {spec!r} ({type(e).__name__}).",
                   "Write it like torch.onnx's dynamic_axes: {'x': [0, 1]} or "
                   "{'x': {0: 'batch'}}.") from e


def dynamic_axes_to_specs(axes: Any) -> dict[str, dict[int, str]]:
    """torch.onnx's old ``dynamic_axes`` ({'x': [0, 1]} or {'x': {0: 'batch'}}) as
    {'x': {0: 'x_dim0', 1: 'x_dim1'}} / {'x': {0: 'batch'}}."""
    ok = isinstance(axes, dict) and all(
        isinstance(k, str) and (
            (isinstance(v, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool)
                                                  and d >= 0 for d in v))
            or (isinstance(v, dict) and all(isinstance(d, int) and not isinstance(d, bool)
                                            and d >= 0 and isinstance(n, str)
                                            and re.fullmatch(r"[A-Za-z_]\w*", n)
                                            for d, n in v.items())))
        for k, v in axes.items())
    if not ok:
        raise _err("OM004", f"cannot read dynamic_axes {axes!r}.",
                   "Map input names to a list of dims or to {dim: name}: {'x': [0, 1]}.")
    return {k: (dict(v) if isinstance(v, dict) else {d: f"{k}_dim{d}" for d in v})
            for k, v in axes.items()}


def _names_nothing(what: str, unknown: list[str], given: list[str]) -> str:
    return (f"{what} names {', '.join(repr(u) for u in unknown)}, which "
            f"{'is' if len(unknown) == 1 else 'are'} not among forward()'s inputs by name "
            f"or position: they are {', '.join(f'{n} (position {i})' for i, n in enumerate(given)) or 'none'}. "
            "Its dims would be dropped and the file would come out static. An output needs "
            "no entry: its dims follow from the inputs'.")


def dynamic_names_problem(model: Any, dynamic_shapes: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> str | None:
    """Why ``dynamic_shapes`` (torch.export's form, or torch.onnx's dynamic_axes) names
    something the model does not have, or None: a dict key that is no input of forward()
    given an example (by name), or a positional spec (tuple or list) with more entries than
    inputs (OM410)."""
    if dynamic_shapes is None or isinstance(dynamic_shapes, str) \
            or not isinstance(model, torch.nn.Module):
        return None
    try:
        kinds = {p.kind for p in inspect.signature(model.forward).parameters.values()}
        names = _forward_names(model, "dynamic_shapes")
    except (InputError, TypeError, ValueError):
        return None
    if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None  # forward(*args, **kw): torch.export matches the spec itself
    given = names[:len(args)] + [k for k in kwargs]
    if isinstance(dynamic_shapes, dict):
        unknown = [k for k in dynamic_shapes if k not in given]
        if unknown:
            return _names_nothing("dynamic_shapes", [str(u) for u in unknown], given)
    elif isinstance(dynamic_shapes, (list, tuple)) and len(dynamic_shapes) > len(given):
        return (f"dynamic_shapes has {len(dynamic_shapes)} positional entries but the model "
                f"is given {len(given)} input(s) ({', '.join(given) or 'none'}): entries "
                f"{len(given)} to {len(dynamic_shapes) - 1} (from 0) name nothing. Give one entry per input, in order "
                "(None for an input with no dynamic dim).")
    return None


def is_dynamic_axes(dyn: Any) -> bool:
    """True for torch.onnx's old dynamic_axes form (lists of ints), which torch.export's
    dynamic_shapes would misread as per-dim specs."""
    return isinstance(dyn, dict) and bool(dyn) and all(
        isinstance(v, (list, tuple)) and v and all(isinstance(d, int) and not isinstance(d, bool)
                                                   for d in v) for v in dyn.values())


def _forward_names(model: Any, what: str) -> list[str]:
    """forward()'s parameter names (positional, then keyword-only), for dynamic-shape specs."""
    fn = model.forward if isinstance(model, torch.nn.Module) else None
    if fn is None:
        raise _err("OM004", f"{what} needs an nn.Module (an ExportedProgram's shapes are fixed "
                   "at capture).")
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def auto_dynamic_shapes(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``dynamic_shapes='auto'``: every dim of every tensor input is torch.export.Dim.AUTO,
    i.e. dynamic unless the model specialises it (torch.export then keeps it static without
    failing); what stayed dynamic is read back from the ONNX model and reported."""
    names = _forward_names(model, "dynamic_shapes='auto'")
    values = dict(zip(names[:len(args)], args)) | dict(kwargs)
    auto = torch.export.Dim.AUTO

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {d: auto for d in range(v.dim())} if v.dim() else None
        if isinstance(v, (list, tuple)):
            return type(v)(spec(x) for x in v)
        if isinstance(v, dict):
            return {k: spec(x) for k, x in v.items()}
        return None

    return {n: spec(v) for n, v in values.items()}


def complete_dynamic_shapes(model: Any, dyn: dict[str, dict[int, str]] | str,
                            args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A torch.export dynamic_shapes dict naming every forward() argument given."""
    if not dyn:
        return None
    if dyn == AUTO:
        return auto_dynamic_shapes(model, args, kwargs)
    names = _forward_names(model, "--dynamic")
    given = names[:len(args)] + [k for k in kwargs]
    unknown = set(dyn) - set(given)
    if unknown:
        raise _err("OM004", _names_nothing("--dynamic", sorted(unknown), given),
                   "Name forward()'s parameters (the ones given an example input).")
    values = dict(zip(names[:len(args)], args)) | dict(kwargs)
    for name, dims in dyn.items():
        t = values[name]
        rank = t.dim() if isinstance(t, torch.Tensor) else 0
        bad = [d for d in dims if d >= rank]
        if bad:
            raise _err("OM004", f"--dynamic {name}: dim {bad[0]} does not exist ({name} has "
                       f"rank {rank}).")
    return {n: dyn.get(n) for n in given}
