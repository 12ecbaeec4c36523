"""Findings for nodes ONNX Runtime has no kernel for on a target, as typed: shared by the fix
stage (what it could not repair) and doctor (what it found)."""

from __future__ import annotations

from typing import Any

from onnxmedic._locate import location_from_onnx_node, onnx_neighbourhood
from onnxmedic.findings import Finding, Severity, warning
from onnxmedic.fixes.dtypes import tensorrt_partitions, tensorrt_table

_DTYPE_FIX = ("Export with dtype_policy='upcast' (--dtype-policy upcast: these nodes compute in "
              "float32 between casts) or 'boundary' (the whole graph in float32, casts at its "
              "inputs and outputs), or cast the model to float32 yourself.")


def kernel_gap_finding(g: Any, target: str, node: Any, stage: str,
                       model: Any = None) -> Finding:
    """OM301 (no kernel) or OM303 (mixed int/float) for one node, with the user's line."""
    if g.kind != "no-kernel":
        what = "its inputs mix integer and float types."
    elif target == "tensorrt":
        what = (f"TensorRT does not take it ({g.detail}), and ONNX Runtime has no CUDA or CPU "
                "kernel for it either.")
    elif g.lower_opset is not None:
        what = (f"ONNX Runtime has no {target} kernel for {g.op}-{g.since_version}, only for "
                f"an older version of it, which opset {g.lower_opset} uses.")
    else:
        what = f"ONNX Runtime has no {target} kernel for it."
    fix = (f"Export with opset={g.lower_opset} (--opset {g.lower_opset}): the node then has a "
           "kernel." if g.lower_opset is not None else _DTYPE_FIX)
    return Finding("OM301" if g.kind == "no-kernel" else "OM303", stage, Severity.ERROR,
                   f"{g.describe()}: {what}", op=g.op, location=location_from_onnx_node(node),
                   suggestion=fix if g.kind == "no-kernel" else
                   "Cast the integer operand to the float dtype in the model (x.float()), or "
                   "export with onnxmedic, which inserts the cast (dtype policy upcast).",
                   details={"node": g.node, "types": g.types, "kind": g.kind,
                            "lower_opset": g.lower_opset,
                            **({"neighbourhood": onnx_neighbourhood(model, node)}
                               if model is not None and node is not None else {})})


def grouped_gap_warning(code: str, gaps: list[Any], stage: str, what: str,
                         suggestion: str) -> Finding:
    names = ", ".join(g.describe() for g in gaps[:8]) + (" ..." if len(gaps) > 8 else "")
    return warning(code, stage, f"{len(gaps)} {what}: {names}.", suggestion=suggestion,
                   details={"nodes": [g.node for g in gaps]})


def cpu_fallback_finding(gaps: list[Any], target: str, stage: str) -> Finding:
    """One OM304 warning for nodes the target provider has no kernel for (they run on CPU)."""
    return grouped_gap_warning(
        "OM304", gaps, stage, f"node(s) have no {'TensorRT or CUDA' if target == 'tensorrt' else target} "
        "kernel as typed; ONNX Runtime runs them on the CPU, with copies to and from the device",
        "Cast them to a dtype the target has kernels for (see ONNX Runtime's "
        "OperatorKernels.md), or accept the CPU fallback.")


def trt_fallback_finding(gaps: list[Any], model: Any, stage: str,
                         off: list[Any] | None = None) -> Finding:
    """One OM305 warning for the nodes TensorRT's parser does not take (they run on CUDA
    between TensorRT engines), with how many engines the graph splits into. ``off``: every
    node away from TensorRT (``gaps`` and those with no CUDA kernel either, which run on the
    CPU): all of them split the engines."""
    parts = tensorrt_partitions(model, off if off is not None else gaps) \
        if model is not None else 0
    f = grouped_gap_warning(
        "OM305", gaps, stage, f"node(s) are not taken by TensorRT {tensorrt_table()['tensorrt']} "
        f"as typed; ONNX Runtime runs them on CUDA, and the graph splits into {parts} TensorRT "
        "engine(s) with copies between them",
        "Rewrite or cast those ops to ones ONNX-TensorRT supports (its docs/operators.md, in "
        "the finding's details), or accept the split; each reason is in details.reasons.")
    f.details["reasons"] = {g.node: g.detail for g in gaps}
    f.details["engines"] = parts
    return f


def soft_kernel_finding(gaps: list[Any], stage: str) -> Finding:
    """One OM302 warning for all float16 nodes ONNX Runtime will wrap in casts on the CPU."""
    return grouped_gap_warning(
        "OM302", gaps, stage, "float16 node(s) have no CPU kernel; ONNX Runtime inserts "
        "float32 casts around them itself (slower)",
        "dtype_policy='boundary' (--dtype-policy boundary) computes the graph in float32 with "
        "casts only at its inputs and outputs.")


