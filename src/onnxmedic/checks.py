"""Stage 4: the ONNX checker and strict shape inference, on the saved file."""

from __future__ import annotations

from pathlib import Path

import onnx

from onnxmedic.findings import Finding, error, warning

STAGE = "check"


def check_file(path: str | Path) -> list[Finding]:
    """Findings from onnx.checker (full check) and strict shape inference; [] when clean."""
    findings: list[Finding] = []
    try:
        onnx.checker.check_model(str(path), full_check=False)
    except Exception as e:
        findings.append(error("OM501", STAGE, f"onnx.checker rejected the model: "
                              f"{_first(str(e))}", details={"error": str(e)[-4000:]}))
        return findings
    try:
        # strict inference on a copy of the graph: we only want the verdict
        model = onnx.load(str(path), load_external_data=False)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                          data_prop=True)
    except Exception as e:
        findings.append(warning("OM502", STAGE, f"ONNX shape inference reports an "
                                f"inconsistency: {_first(str(e))}",
                                suggestion="ONNX Runtime may still run the model (it is "
                                "checked next); other runtimes may refuse it.",
                                details={"error": str(e)[-4000:]}))
    return findings


PROTOBUF_LIMIT = 2**31  # bytes: protobuf cannot serialise or parse a larger message


def load_onnx(path: str | Path, stage: str = "check") -> tuple[onnx.ModelProto | None,
                                                              Finding | None]:
    """Load an ONNX file given by the user (without external data) or explain why not."""
    p = Path(path)
    if not p.is_file():
        return None, error("OM007", stage, f"ONNX file {str(path)!r} does not exist.")
    size = p.stat().st_size
    if size == 0:
        return None, error("OM007", stage, f"{str(path)!r} is empty.")
    if size >= PROTOBUF_LIMIT:  # refuse before reading gigabytes that protobuf cannot parse
        return None, error("OM007", stage, f"{str(path)!r} is {size / 2**30:.1f} GiB, over "
                           "protobuf's 2 GiB limit for one message, so no ONNX reader can parse "
                           "it (it is truncated, corrupt, or was written wrongly).",
                           suggestion="Keep the weights in external data: onnx.save(model, path, "
                           "save_as_external_data=True, location='weights.bin'); onnxmedic "
                           "export does this itself for models over 2 GiB.")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as e:
        return None, error("OM007", stage, f"{str(path)!r} is not a readable ONNX model (it may "
                           f"be truncated or corrupt): {type(e).__name__}: {_first(str(e))}",
                           suggestion="Re-export or re-download the file; compare its size "
                           "with the original.")
    if not model.graph.node and not model.graph.output:
        return None, error("OM007", stage, f"{str(path)!r} parsed but holds no graph; it is "
                           "probably not an ONNX file.")
    return model, None


def _first(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " ".join(lines[:2])[:500]
