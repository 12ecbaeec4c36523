"""The check stage: the ONNX checker and strict shape inference, on the saved file."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import onnx

from onnxmedic.findings import Finding, Severity, error, info, warning
from onnxmedic.onnxfile import (
    all_graphs,
    has_external_data_file,
    save_program,
    saved_proto,
    skeleton,
)
from onnxmedic.onnxfile import first_lines as _first

STAGE = "check"


def check_model(proto: onnx.ModelProto) -> list[Finding]:
    """Findings from onnx.checker and strict shape inference; [] when clean. Both run on the
    model's skeleton (onnxfile.skeleton: weights left out), so their cost does not grow with
    the weights and a model over 2 GiB needs no second copy."""
    findings: list[Finding] = []
    model = skeleton(proto)
    if ort_ops := _ort_defined(model):
        findings.append(ort_ops)
    try:
        onnx.checker.check_model(model, full_check=False)
    except Exception as e:
        findings.append(error("OM501", STAGE, f"onnx.checker rejected the model: "
                              f"{_first(str(e))}", details={"error": str(e)[-4000:]}))
        return findings
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                          data_prop=True)
    except Exception as e:
        findings.append(warning("OM502", STAGE, f"ONNX shape inference reports an "
                                f"inconsistency: {_first(str(e))}",
                                suggestion="ONNX Runtime may still run the model (it is "
                                "checked next); other runtimes may refuse it.",
                                details={"error": str(e)[-4000:]}))
    return findings


# where the checker is pointed for ops ONNX Runtime defines in the ONNX domain (no schema of
# onnx's own there, so it checks the rest of the graph around them)
ORT_DOMAIN = "com.microsoft"


def _ort_defined(model: onnx.ModelProto) -> Finding | None:
    """OM739 (info) for nodes of the ONNX domain that are no ONNX operator but one ONNX Runtime
    defines there (onnxruntime-genai's builder writes SimplifiedLayerNormalization so): they
    are moved to ONNX Runtime's contrib domain in ``model`` (the checker's skeleton), whose
    ops the checker does not judge, so that the rest of the graph is checked instead of the
    file being rejected (OM501) for what ONNX Runtime runs. None when there are none."""
    graphs = all_graphs(model.graph)
    unknown = {n.op_type for g in graphs for n in g.node
               if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)}
    if not unknown:
        return None
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

        ort_ops = {s.name for s in ort_c.get_all_operator_schema() if s.domain in ("", "ai.onnx")}
    except Exception:  # noqa: BLE001 - without ONNX Runtime's schemas the checker judges alone
        return None
    moved = sorted(unknown & ort_ops)
    if not moved:
        return None
    count = 0
    for g in graphs:
        for n in g.node:
            if n.domain in ("", "ai.onnx") and n.op_type in moved:
                n.domain, count = ORT_DOMAIN, count + 1
    if not any(o.domain == ORT_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ORT_DOMAIN, 1))
    return info("OM739", STAGE, f"{count} node(s) of ONNX Runtime's own operators in the ONNX "
                f"domain ({', '.join(moved)}): no ONNX operator, so onnx.checker cannot judge "
                "them; ONNX Runtime defines and runs them, other runtimes will refuse the file.",
                suggestion="Serve it with ONNX Runtime (onnxruntime-genai's builder writes "
                "these ops so), or export with onnxmedic's own backend for a portable file.")


def check_file(path: str | Path) -> list[Finding]:
    """check_model on a file (read without its external data)."""
    return check_model(onnx.load(str(path), load_external_data=False))


def save_and_check_stage(ctx: Any) -> bool:
    """Export's check stage: the translated model saved to a temporary folder beside the
    destination (published by the write stage when verified), then checked."""
    result = ctx.result
    parent = ctx.dest.parent if ctx.dest is not None else None
    if ctx.tmp_dir is not None:  # run again (a lower opset): the first save goes entirely
        shutil.rmtree(ctx.tmp_dir, ignore_errors=True)
    ctx.tmp_dir = Path(tempfile.mkdtemp(prefix=".onnxmedic-", dir=parent))
    with result.timed("write"):
        try:
            ctx.onnx_path = save_program(ctx.onnx_program, ctx.tmp_dir, ctx.name)
        except OSError as e:
            result.fail("write", error("OM006", "write", f"cannot write the model: {e}"))
            return False
        if has_external_data_file(ctx.onnx_path):
            # keep the graph and references only, not a second in-memory copy of the weights
            # (localisation reads them from the file)
            result.onnx_model = saved_proto(ctx.onnx_program, ctx.onnx_path)
    with result.stage(STAGE) as st:
        found = check_model(result.onnx_model)
        st.add(*found)
        if any(x.severity == Severity.ERROR for x in found):
            st.fail()
    return not st.failed
