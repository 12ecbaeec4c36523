"""Lint an ONNX file for a runtime without PyTorch, and run it safely with checked inputs.

Both treat the file as untrusted: external-data locations that leave the model's folder are
refused before any runtime sees them, and ONNX Runtime only ever runs in the sandbox.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxmedic.findings import Finding, error, info, warning

STAGE = "lint"

ONNX_TO_NUMPY: dict[int, Any] = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.UINT16: np.uint16, onnx.TensorProto.UINT32: np.uint32,
    onnx.TensorProto.UINT64: np.uint64, onnx.TensorProto.BOOL: np.bool_,
}


def _bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def numpy_dtype(elem_type: int) -> Any:
    if elem_type == onnx.TensorProto.BFLOAT16:
        return np.dtype(_bf16())
    if elem_type not in ONNX_TO_NUMPY:
        raise KeyError(onnx.TensorProto.DataType.Name(elem_type))
    return np.dtype(ONNX_TO_NUMPY[elem_type])


def _all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    out = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                out += _all_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    out += _all_graphs(g)
    return out


def external_data_findings(model: onnx.ModelProto, model_path: str | Path,
                           stage: str = STAGE) -> list[Finding]:
    """Refuse external-data locations outside the model's folder; report missing files."""
    base = Path(model_path).resolve().parent
    findings: list[Finding] = []
    seen: set[str] = set()
    for g in _all_graphs(model.graph):
        tensors = list(g.initializer) + [a.t for n in g.node for a in n.attribute
                                         if a.type == onnx.AttributeProto.TENSOR]
        for t in tensors:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            loc = next((e.value for e in t.external_data if e.key == "location"), "")
            if loc in seen:
                continue
            seen.add(loc)
            target = (base / loc).resolve()
            escapes = (not loc or os.path.isabs(loc) or ".." in Path(loc).parts
                       or not str(target).startswith(str(base) + os.sep))
            if escapes:
                findings.append(error(
                    "OM520", stage, f"tensor {t.name!r} points its external data at {loc!r}, "
                    "outside the model's folder; the file was refused before any runtime "
                    "read it.", suggestion="Only trust this model if you know where it came "
                    "from; a legitimate export keeps external data beside the model "
                    "(model.onnx.data).", details={"tensor": t.name, "location": loc}))
            elif not target.is_file():
                findings.append(error(
                    "OM521", stage, f"external data file {loc!r} (tensor {t.name!r}) is "
                    f"missing from {base}.", suggestion="Copy the .data file that was saved "
                    "with the model into the same folder.",
                    details={"tensor": t.name, "location": loc}))
    return findings


def lint(model: onnx.ModelProto, ort_opset: int | None = None) -> list[Finding]:
    """Static findings about a loaded model (no runtime)."""
    findings: list[Finding] = []
    g = model.graph
    init_names = {i.name for i in g.initializer}
    used: set[str] = set()
    for sub in _all_graphs(g):
        for n in sub.node:
            used.update(n.input)
    used.update(o.name for o in g.output)
    unused = sorted(init_names - used)
    if unused:
        nbytes = sum(int(np.prod(i.dims or [1])) for i in g.initializer if i.name in unused)
        findings.append(warning(
            "OM530", STAGE, f"{len(unused)} initializer(s) are never used "
            f"({', '.join(unused[:5])}{'…' if len(unused) > 5 else ''}; ~{nbytes} elements).",
            suggestion="Remove them (onnxscript's optimizer or onnx-ir's "
            "RemoveUnusedNodesPass) to shrink the file.", details={"unused": unused}))
    dyn = []
    for v in list(g.input) + list(g.output):
        if v.name in init_names:
            continue
        dims = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else []
        names = [d.dim_param or "?" for d in dims if not d.HasField("dim_value")]
        if names:
            dyn.append(f"{v.name}[{', '.join(names)}]")
    if dyn:
        findings.append(info("OM531", STAGE, "dynamic dimensions: " + "; ".join(dyn),
                             details={"dynamic": dyn}))
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        known = {v.name for v in inferred.graph.value_info} | {o.name for o in g.output} | {
            i.name for i in g.input} | init_names
        missing = [o for n in g.node for o in n.output if o and o not in known]
        if missing:
            findings.append(info(
                "OM532", STAGE, f"{len(missing)} intermediate value(s) have no type/shape "
                f"information after ONNX shape inference (e.g. {missing[0]!r}).",
                suggestion="Runtimes that plan memory ahead (TensorRT) may need shapes; "
                "onnx.shape_inference or symbolic shape inference can add them.",
                details={"missing": missing[:50]}))
    except Exception:
        pass  # the checker finding covers broken models
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if ort_opset is not None and opset is not None and opset > ort_opset:
        findings.append(error(
            "OM533", STAGE, f"the model uses opset {opset}; this ONNX Runtime supports opsets up "
            f"to {ort_opset}.", suggestion=f"Re-export with --opset {ort_opset} or convert with "
            f"onnx.version_converter.convert_version(model, {ort_opset}), or upgrade ONNX "
            "Runtime."))
    return findings


def random_feeds(model: onnx.ModelProto, seed: int = 0, dynamic_size: int = 2
                 ) -> tuple[dict[str, np.ndarray], list[str]]:
    """Random inputs matching the model's inputs (dynamic dims set to ``dynamic_size``)."""
    rng = np.random.default_rng(seed)
    init_names = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for v in model.graph.input:
        if v.name in init_names:
            continue
        if not v.type.HasField("tensor_type"):
            problems.append(f"{v.name}: not a tensor input")
            continue
        tt = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dynamic_size for d in tt.shape.dim]
        try:
            dt = numpy_dtype(tt.elem_type)
        except KeyError as e:
            problems.append(f"{v.name}: element type {e} has no random generator")
            continue
        size = int(np.prod(shape)) if shape else 1
        if size > 2**28 or any(d > 2**31 for d in shape):
            problems.append(f"{v.name}: shape {shape} is too large for a smoke test")
            continue
        if dt == np.bool_:
            a = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(dt, np.integer):
            a = rng.integers(0, 4, size=shape).astype(dt)
        else:
            a = rng.standard_normal(size=shape).astype(np.float32).astype(dt)
        feeds[v.name] = a
    return feeds, problems


def check_feeds(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, cast: str = "no"
                ) -> tuple[dict[str, np.ndarray], list[Finding]]:
    """Check feeds against the model's input contract. ``cast``: "no", "safe" (lossless casts
    only, e.g. int32 -> int64, float16 -> float32) or "all" (any cast, values may change)."""
    init_names = {i.name for i in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in init_names]
    findings: list[Finding] = []
    out: dict[str, np.ndarray] = {}
    names = [v.name for v in inputs]
    extra = sorted(set(feeds) - set(names))
    if extra:
        findings.append(error("OM008", "inputs", f"inputs {', '.join(extra)} are not inputs of "
                              f"the model (its inputs: {', '.join(names)}).",
                              suggestion="Name .npz arrays after the model's inputs, or give "
                              "them positionally in order."))
    for v in inputs:
        if v.name not in feeds:
            findings.append(error("OM008", "inputs", f"input {v.name!r} was not given."))
            continue
        a = np.asarray(feeds[v.name])
        tt = v.type.tensor_type
        want = numpy_dtype(tt.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if a.ndim != len(dims):
            findings.append(error("OM008", "inputs", f"input {v.name!r} has rank {a.ndim} "
                                  f"(shape {list(a.shape)}); the model wants rank {len(dims)} "
                                  f"({['?' if d is None else d for d in dims]}).",
                                  suggestion="Reshape the input, e.g. add the batch dimension "
                                  "with x[None]."))
            continue
        bad_dims = [(i, d, a.shape[i]) for i, d in enumerate(dims) if d is not None and
                    d != a.shape[i]]
        if bad_dims:
            i, d, got = bad_dims[0]
            findings.append(error("OM008", "inputs", f"input {v.name!r} dim {i} is {got}; the "
                                  f"model fixes it to {d}.",
                                  suggestion="That dimension was exported static: feed that "
                                  "size, or re-export with --dynamic."))
            continue
        if a.dtype != want:
            lossless = np.can_cast(a.dtype, want, casting="safe")
            if cast == "all" or (cast == "safe" and lossless):
                out[v.name] = a.astype(want)
                findings.append(info("OM008", "inputs", f"input {v.name!r} cast from {a.dtype} "
                                     f"to {want}."))
                continue
            findings.append(error(
                "OM008", "inputs", f"input {v.name!r} is {a.dtype}; the model wants {want}.",
                suggestion=(f"Convert it (x.astype(np.{want})) or pass --cast" +
                            ("" if lossless else "-lossy (values may change)") + ".")))
            continue
        out[v.name] = a
    return out, findings
