"""onnxmedic: get any PyTorch model into ONNX Runtime, verified, or say exactly why not.

    import onnxmedic
    result = onnxmedic.export(model, (x,), "model.onnx")
    if not result.ok:
        for finding in result.findings:
            print(finding.one_paragraph())
"""

from __future__ import annotations

from onnxmedic.api import (
    ExportResult,
    RunResult,
    SweepResult,
    VerifyResult,
    ZooCase,
    doctor,
    export,
    localize,
    reduce,
    run,
    sweep,
    verify,
)
from onnxmedic.findings import CODES, Finding, Location, Severity
from onnxmedic.hf import export_pretrained
from onnxmedic.ops import translation
from onnxmedic.optimize import bench, optimize
from onnxmedic.version import __version__

__all__ = [
    "CODES",
    "ExportResult",
    "RunResult",
    "SweepResult",
    "ZooCase",
    "Finding",
    "Location",
    "Severity",
    "VerifyResult",
    "__version__",
    "bench",
    "doctor",
    "export",
    "export_pretrained",
    "localize",
    "optimize",
    "reduce",
    "run",
    "sweep",
    "translation",
    "verify",
]
