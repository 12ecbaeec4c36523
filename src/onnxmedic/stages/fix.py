"""The fix stage: nodes ONNX Runtime has no kernel for on the target (from its own kernel
registrations), repaired with casts per the dtype policy (see fixes/dtypes.py), and the CPU
stand-in that verifies a GPU-target model on a machine without the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from onnxmedic.context import ExportContext, Rerun
from onnxmedic.findings import Severity, info, warning
from onnxmedic.fixes import dtypes as fx
from onnxmedic.fixes import try_fix
from onnxmedic.fixes.kernels import (
    cpu_fallback_finding,
    kernel_gap_finding,
    soft_kernel_finding,
    trt_fallback_finding,
)
from onnxmedic.onnxfile import has_external_data, save_program, saved_proto
from onnxmedic.quantized import WeightZeroPoints
from onnxmedic.sandbox import providers
from onnxmedic.stages import check as checks

STAGE = "fix"


def fix_stage(ctx: ExportContext) -> bool:
    """Find every node without a kernel on the target as typed and repair it per the dtype
    policy. False when the model cannot run there and was not repaired."""
    result, target, policy = ctx.result, ctx.opts.target, ctx.opts.dtype_policy
    with result.stage(STAGE, conclude=False) as st:
        if try_fix(WeightZeroPoints(), ctx.onnx_program.model):  # quantized.py
            path = save_program(ctx.onnx_program, ctx.tmp_dir, ctx.name)
            result.onnx_model = saved_proto(ctx.onnx_program, path)
        nodes = {n.name: n for n in result.onnx_model.graph.node}
        report = try_fix(fx.DtypeRepair(target, policy), ctx.onnx_program.model,
                         check_on=result.onnx_model)
        if report is None:
            st.passed()
            return True
        if report.fixed:
            path = save_program(ctx.onnx_program, ctx.tmp_dir, ctx.name)
            result.onnx_model = saved_proto(ctx.onnx_program, path)
    st.add(*_not_fixed_warnings(report, target, result.onnx_model))
    hard = [(g, reason) for g, reason in report.not_fixed if g.kind not in _SOFT]
    if hard and can_lower_opset(ctx, [g for g, _ in hard]):
        return lowered_opset(ctx, [g for g, _ in hard])
    blocking = [_gap_error(g, reason, target, nodes, result.onnx_model) for g, reason in hard]
    st.add(*blocking)
    ok = not blocking
    if report.fixed:
        st.add(_fixed_finding(report, policy, target))
        check_findings = checks.check_model(result.onnx_model)
        st.add(*check_findings)
        ok &= not any(x.severity == Severity.ERROR for x in check_findings)
    if ok:
        st.passed()
    else:
        st.fail()
    return ok


_SOFT = ("soft", "cpu-fallback", "trt-fallback")


def can_lower_opset(ctx: ExportContext, gaps: list[Any]) -> bool:
    """Every blocking gap is an op version ONNX Runtime has no kernel for while an older
    version of the op has one, and the opset was not asked for (nor lowered already)."""
    return (ctx.opts.opset is None and ctx.opset_lowered_from is None
            and all(g.lower_opset is not None for g in gaps))


def lowered_opset(ctx: ExportContext, gaps: list[Any]) -> bool:
    """Ask the pipeline to translate, check and fix again (``ctx.rerun``, from the translate
    stage, as the fix stage declares) at the newest opset whose op versions ONNX Runtime runs
    (RandomUniformLike-22 has no kernel; opset 21's RandomUniformLike-1 has): the default opset
    is the highest the target supports, and these ops say it is lower (OM325)."""
    ops = sorted({f"{g.op}-{g.since_version}" for g in gaps})
    ctx.opset_lowered_from, old = ctx.opset, ctx.opset
    ctx.opset = min(g.lower_opset for g in gaps)
    ctx.opset_bound = f"ONNX Runtime's kernels for {', '.join(ops)}"
    ctx.rerun = Rerun("translate", info(
        "OM325", STAGE, f"ONNX Runtime has no kernel for {', '.join(ops)} (node(s) "
        f"{', '.join(sorted({g.node for g in gaps})[:5])}) at opset {old}, but has one for the "
        f"op's previous version: translated again at opset {ctx.opset}.",
        suggestion=f"Nothing to do; pass opset={ctx.opset} to skip the first translation.",
        details={"from": old, "to": ctx.opset, "ops": ops}))
    return True


def _not_fixed_warnings(report: Any, target: str, model: Any) -> list[Any]:
    """Gaps that do not stop the model (slow kernels, fallbacks to another provider)."""
    out = []
    soft = [g for g, _ in report.not_fixed if g.kind == "soft"]
    if soft:
        out.append(soft_kernel_finding(soft, STAGE))
    moved = [g for g, _ in report.not_fixed if g.kind == "cpu-fallback"]
    if moved:
        out.append(cpu_fallback_finding(moved, target, STAGE))
    off_trt = [g for g, _ in report.not_fixed if g.kind == "trt-fallback"]
    if off_trt:
        out.append(trt_fallback_finding(off_trt, model, STAGE, off_trt + moved))
    return out


def _gap_error(g: Any, reason: str, target: str, nodes: dict[str, Any], model: Any) -> Any:
    f = kernel_gap_finding(g, target, nodes.get(g.node), STAGE, model)
    if not reason.startswith("dtype policy") and g.lower_opset is None:
        f.code = "OM311"
        f.message += f" Not repaired: {reason}."
    return f


def _fixed_finding(report: Any, policy: str, target: str) -> Any:
    ops = sorted({g.op for g in report.fixed})
    return info(
        "OM310", STAGE, f"dtype policy {policy!r}: {len(report.fixed)} node(s) "
        f"({', '.join(ops)}) had no {target} kernel as typed; {report.casts_added} cast(s) "
        "inserted" + (" at the graph's inputs and outputs" if policy == "boundary" else
                      " around them") + "; the repaired model is verified below.",
        details={"nodes": [g.describe() for g in report.fixed], "policy": policy,
                 "casts": report.casts_added})


def cpu_stand_in(result: Any, onnx_path: Path, folder: Path,
                  target: str) -> tuple[Path, Any] | None:
    """For a GPU target on a machine without one: when the model has nodes with no CPU kernel as
    typed (bfloat16 Gemm has a CUDA kernel, none on the CPU), ONNX Runtime falls back to the CPU
    and cannot load it. Verify a copy with those nodes computed in float32 between casts instead
    (OM537; the written model is unchanged). None when not needed or not possible."""
    if target == "cpu":
        return None
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            return None  # a GPU build: the target (or its CUDA fallback) runs it
    except Exception:
        return None
    gaps = [g for g in fx.kernel_gaps(result.onnx_model, "cpu") or [] if g.kind == "no-kernel"]
    if not gaps:
        return None
    copy = ir.load(onnx_path)
    report = fx.apply_policy(copy, gaps, "upcast")
    if not report.fixed or report.not_fixed:
        return None
    path = folder / onnx_path.name
    ir.save(copy, path, external_data=f"{onnx_path.name}.data"
            if has_external_data(result.onnx_model) else None)
    result.findings.append(warning(
        "OM537", "runtime", f"{providers(target)[0]} is not available here and "
        f"{len(report.fixed)} node(s) have no CPU kernel as typed "
        f"({', '.join(sorted({g.op for g in report.fixed}))}); verified a CPU stand-in with those "
        "nodes computed in float32 between casts. The written model is unchanged (it has "
        f"kernels on {target}) and was not run as written.",
        suggestion=f"Verify on a machine with the {target} provider (onnxmedic doctor "
        f"--target {target} there) before deploying.",
        details={"nodes": [g.describe() for g in report.fixed]}))
    return path, onnx.load(path)


