"""onnxmedic: get any PyTorch model into ONNX Runtime, verified, or say exactly why not."""

from __future__ import annotations

from onnxmedic.ops import translation

__version__ = "0.1.0"

__all__ = ["__version__", "translation"]
