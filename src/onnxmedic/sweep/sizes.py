"""What a zoo entry's user declared dynamic, checked on the written file apart from the export.

The export verifies the sizes its ONNX file declares dynamic. ``size_check`` starts from the
other end - the dims the *user* declared in ``dynamic_shapes`` - and runs the written file in a
fresh ONNX Runtime session at each declared symbol's size 1, the example's size, twice it and
the first prime above that (the others kept at the example's), against PyTorch on the same
inputs; so a file that silently fixed a declared dim ("Got invalid dimensions for input") or
computes another size wrong fails the entry. Sizes PyTorch itself rejects are skipped. A dim
the file declares valid only at some sizes (OM408: its metadata_props
'onnxmedic.dim_constraints') is checked at sizes its rule allows.

``dim_objects`` spells an entry's dynamic shapes with ``torch.export.Dim`` objects instead of
strings (one Dim per name), for zoos that export every entry both ways.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from onnxmedic.inputs import DEFAULT_SEED, Inputs
from onnxmedic.onnxfile import graph_io, make_feeds
from onnxmedic.stages.verify import expected_outputs
from onnxmedic.verify.budget import RULE_PENDING, judge_output
from onnxmedic.verify.input_sets import next_prime, resized_sets
from onnxmedic.verify.reference import reference_outputs
from onnxmedic.verify.size_rules import SizeRule, rules_from_metadata

# the error texts of a size that fails, kept in the check's record
_MAX_TEXT = 300


def dim_objects(dynamic_shapes: Any) -> Any:
    """``dynamic_shapes`` with every string dim name replaced by a ``torch.export.Dim`` of that
    name (the same object wherever the name recurs); dict keys, ints, None and Dims as given."""
    dims: dict[str, Any] = {}

    def conv(x: Any) -> Any:
        if isinstance(x, str):
            if x not in dims:
                dims[x] = torch.export.Dim(x)
            return dims[x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(conv(v) for v in x)
        return x

    return conv(dynamic_shapes)


def declared_dims(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  dynamic_shapes: Any) -> dict[str, list[tuple[int, int]]]:
    """Each dynamic symbol the user declared -> the (leaf index, dim) it sizes, the leaves being
    ``torch.utils._pytree.tree_leaves((args, kwargs))``. A symbol is a string or a Dim's name;
    an unnamed Dim (AUTO, DYNAMIC) is its own symbol. Structures that do not line up with the
    inputs are left out (not checked)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    index = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
    out: dict[str, list[tuple[int, int]]] = {}
    for path, value, spec in _pairs(model, args, kwargs, dynamic_shapes):
        if not isinstance(value, torch.Tensor) or id(value) not in index:
            continue
        dims = spec.items() if isinstance(spec, dict) else enumerate(spec)
        for d, s in dims:
            if s is None or not isinstance(d, int) or not 0 <= d < value.dim():
                continue
            name = s if isinstance(s, str) else getattr(s, "__name__", None) or f"{path}.dim{d}"
            out.setdefault(name, []).append((index[id(value)], d))
    return out


def _pairs(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], spec: Any
           ) -> Iterator[tuple[str, Any, Any]]:
    """(path, input value, its spec) for each tensor-level spec (a dict of dims or a list of
    per-dim entries against a tensor)."""
    if spec is None:
        return
    if isinstance(spec, dict) and not all(isinstance(k, int) for k in spec):
        try:
            bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
        except (TypeError, ValueError):
            bound = dict(kwargs)
        for name, s in spec.items():
            if name in bound:
                yield from _walk(name, bound[name], s)
        return
    yield from _walk("input", tuple(args) if isinstance(spec, (list, tuple)) and
                     len(spec) == len(args) else args[0] if len(args) == 1 else args, spec)


def _walk(path: str, value: Any, spec: Any) -> Iterator[tuple[str, Any, Any]]:
    if spec is None:
        return
    if isinstance(value, torch.Tensor):
        if isinstance(spec, (dict, list, tuple)):
            yield path, value, spec
        return
    if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        for i, (v, s) in enumerate(zip(value, spec)):
            yield from _walk(f"{path}[{i}]", v, s)
    elif isinstance(value, dict) and isinstance(spec, dict):
        for k, v in value.items():
            if k in spec:
                yield from _walk(f"{path}.{k}", v, spec[k])


def check_sizes(n: int) -> list[int]:
    """The sizes a symbol of example size ``n`` is checked at: 1, n, 2n and a prime above 2n."""
    return sorted({1, n, 2 * n, next_prime(2 * n)})


def size_variants(args: tuple[Any, ...], kwargs: dict[str, Any],
                  symbols: dict[str, list[tuple[int, int]]], seed: int = DEFAULT_SEED,
                  rules: dict[str, SizeRule] | None = None) -> list[tuple[str, Inputs]]:
    """One input set per (symbol, size in ``check_sizes``): the symbol's tensors resized,
    values drawn in each tensor's own range (integer ids stay valid, an all-ones mask stays all
    ones). A symbol with a size rule (``rules``, the file's own: verify/size_rules.py) is
    checked at the sizes its rule allows instead (the smallest, n, about 2n, k times a
    prime)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    gen = torch.Generator().manual_seed(seed + 211)
    out = []
    for name, uses in symbols.items():
        rule = (rules or {}).get(name)
        sized = {name: (int(leaves[uses[0][0]].shape[uses[0][1]]), uses)}
        out += resized_sets(Inputs(tuple(args), dict(kwargs)), sized,
                            rule.check_sizes if rule is not None else check_sizes, gen)
    return out


def file_rules(proto: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               symbols: dict[str, list[tuple[int, int]]]) -> dict[str, SizeRule]:
    """The size rules the ONNX file declares (OM408), by the declared symbol they apply to:
    matched by the ONNX dim name at the symbol's first (input, dim)."""
    declared = rules_from_metadata(proto)
    if not declared:
        return {}
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    tensor_idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    _, onnx_dims, _ = graph_io(proto)
    out = {}
    for name, uses in symbols.items():
        li, d = uses[0]
        k = tensor_idx.index(li) if li in tensor_idx else -1
        dim = onnx_dims[k][d] if 0 <= k < len(onnx_dims) and d < len(onnx_dims[k]) else None
        rule = declared.get(dim) if isinstance(dim, str) else declared.get(name)
        if rule is not None:
            out[name] = rule
    return out


def size_check(onnx_path: str, case: Any) -> dict[str, Any]:
    """Run the written file at the sizes the case declared dynamic (see the module docstring);
    ``{"ok", "sizes": {label: "ok" | "skipped: ..." | "failed: ..."}, "checked", "message"}``."""
    import onnx
    import onnxruntime as ort

    symbols = declared_dims(case.model, case.args, case.kwargs, case.dynamic_shapes)
    rules = file_rules(onnx.load(onnx_path, load_external_data=False), case.args, case.kwargs,
                       symbols)
    sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    outs = [o.name for o in sess.get_outputs()]
    sizes: dict[str, str] = {}
    for label, inputs in size_variants(case.args, case.kwargs, symbols, rules=rules):
        try:
            (expected,) = expected_outputs(case.model, [inputs])
        except Exception as e:
            sizes[label] = f"skipped: PyTorch rejects it ({type(e).__name__})"
            continue
        sizes[label] = _run_one(sess, names, outs, inputs, expected, case.tolerance,
                                case.model)
    failed = [f"{k}: {v[len('failed: '):]}" for k, v in sizes.items() if v.startswith("failed")]
    checked = sum(v == "ok" for v in sizes.values())
    return {"ok": not failed, "symbols": sorted(symbols), "checked": checked, "sizes": sizes,
            "rules": {k: r.describe() for k, r in sorted(rules.items())},
            "message": "" if not failed else "the written file fails at a size declared "
            "dynamic: " + "; ".join(failed[:3])}


def _run_one(sess: Any, names: list[str], outs: list[str], inputs: Inputs,
             expected: list[np.ndarray], tolerance: Any, model: Any) -> str:
    try:
        actual = sess.run(None, make_feeds(names, inputs.args, inputs.kwargs))
    except Exception as e:
        return "failed: " + " ".join(str(e).split())[:_MAX_TEXT]
    # PyTorch's output against ONNX Runtime's by the export's own rule: float32 agreement
    # first, and the float64 budget (one float64 run of the model) for an output that is not
    # as close as that; a user tolerance keeps its meaning
    reference: list[Any] | None = None
    for i, exp in enumerate(expected):
        name = outs[i] if i < len(outs) else f"output_{i}"
        got = actual[i] if i < len(actual) else None
        c = judge_output(name, exp, got, None, input_set=inputs.specs[0],
                         tolerance=tolerance, fast=True)
        if c.rule == RULE_PENDING:
            if reference is None:
                reference = (reference_outputs(model, [inputs], [expected]).outputs
                             or [[None] * len(expected)])[0]
            c = judge_output(name, exp, got, reference[i], input_set=inputs.specs[0],
                             tolerance=tolerance)
        if not c.ok:
            return f"failed: output {c.name}: {c.reason}"
    if len(actual) != len(expected):
        return f"failed: {len(actual)} outputs, PyTorch gives {len(expected)}"
    return "ok"


def with_size_check(make: Callable[[], Any], dims: bool = False) -> Callable[[], Any]:
    """A zoo factory whose case also runs ``size_check`` after its own check (if any); with
    ``dims``, its dynamic shapes spelled as ``torch.export.Dim`` objects."""

    def wrapped() -> Any:
        case = make()
        own = case.check
        if dims:
            case.dynamic_shapes = dim_objects(case.dynamic_shapes)

        def check(onnx_path: str, c: Any) -> dict[str, Any]:
            first = own(onnx_path, c) if own is not None else {"ok": True}
            sizes = size_check(onnx_path, c)
            return {**first, "ok": bool(first.get("ok")) and sizes["ok"], "size_check": sizes,
                    "message": first.get("message") or sizes["message"]}

        case.check = check
        return case

    return wrapped
