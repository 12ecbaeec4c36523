"""Stage 2: capture the model as an ExportedProgram with a chain of strategies."""

from __future__ import annotations

from onnxmedic.capture.strategies import (
    CAPTURE_STRATEGIES,
    CaptureStrategy,
    Result,
    capture,
    classify_capture_error,
)

__all__ = ["CAPTURE_STRATEGIES", "CaptureStrategy", "Result", "capture", "classify_capture_error"]
