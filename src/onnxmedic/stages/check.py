"""The check stage: the ONNX checker and strict shape inference, on the saved file."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import onnx

from onnxmedic.findings import Finding, Severity, error, warning
from onnxmedic.onnxfile import first_lines as _first
from onnxmedic.onnxfile import has_external_data_file, save_program, saved_proto, skeleton

STAGE = "check"


def check_model(proto: onnx.ModelProto) -> list[Finding]:
    """Findings from onnx.checker and strict shape inference; [] when clean. Both run on the
    model's skeleton (onnxfile.skeleton: weights left out), so their cost does not grow with
    the weights and a model over 2 GiB needs no second copy."""
    findings: list[Finding] = []
    model = skeleton(proto)
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
