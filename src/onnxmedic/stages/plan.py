"""The plan stage: the export opset fixed before anything runs (fixes/opset.py holds the
opset and ONNX Runtime tables it reads)."""

from __future__ import annotations

from typing import Any

from onnxmedic.findings import error
from onnxmedic.fixes.opset import limits


def plan_opset(ctx: Any) -> bool:
    """Fix the export opset before anything runs: the one asked for, checked against the ONNX
    Runtime release asked for (OM322), or - when none is asked for - the highest the target
    supports, chosen by fixes.opset.resolve_opset when translation starts (the installed
    onnxruntime's kernels, asked for here, are read then)."""
    ort, opset = ctx.opts.ort_version, ctx.opts.opset
    if ort is not None:
        lim = limits(ort)
        if lim is None:
            ctx.result.fail("translate", error(
                "OM322", "translate", f"ONNX Runtime {'.'.join(map(str, ort))} is "
                "older than 1.0; onnxmedic cannot target it."))
            return False
        if opset is not None and opset > lim[0]:
            ctx.result.fail("translate", error(
                "OM322", "translate", f"opset {opset} was asked for, but ONNX Runtime "
                f"{'.'.join(map(str, ort))} loads opsets up to {lim[0]}.",
                suggestion=f"Use --opset {lim[0]} or lower, or a newer ONNX Runtime."))
            return False
    # the installed onnxruntime's kernels (a child process, ~0.5 s) are asked for while the
    # model runs and is captured: the default opset (resolve_opset, when translation starts)
    # and the dtype fixes read them
    from onnxmedic.fixes.dtypes import prefetch_kernels

    prefetch_kernels()
    if opset is not None:
        ctx.opset, ctx.opset_bound = opset, "asked for"
    return True
