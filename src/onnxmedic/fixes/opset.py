"""Which opset and IR version an ONNX Runtime release can load, and fitting a model to one.

The table is ONNX Runtime's own compatibility matrix (docs/reference/compatibility.md in
microsoft/onnxruntime: "ONNX Runtime version | ONNX version | ONNX opset version | ONNX ML
opset version | ONNX IR version"). Releases after the last row are given that row's figures,
a lower bound: they load at least what it did.
"""

from __future__ import annotations

import re

# ORT (major, minor) -> (max ai.onnx opset, max IR version)
ORT_MATRIX: dict[tuple[int, int], tuple[int, int]] = {
    (1, 20): (21, 10), (1, 19): (21, 10), (1, 18): (21, 10), (1, 17): (20, 9),
    (1, 16): (19, 9), (1, 15): (19, 8), (1, 14): (18, 8), (1, 13): (17, 8), (1, 12): (17, 8),
    (1, 11): (16, 8), (1, 10): (15, 8), (1, 9): (15, 8), (1, 8): (14, 7), (1, 7): (13, 7),
    (1, 6): (13, 7), (1, 5): (12, 7), (1, 4): (12, 7), (1, 3): (12, 7), (1, 2): (11, 6),
    (1, 1): (11, 6), (1, 0): (11, 6),
}
NATIVE_OPSET = 18  # torchlib's translations are written for opset 18


def default_opset() -> int:
    """The opset torch.onnx exports at when none is asked for (20 in torch 2.13)."""
    try:
        from torch.onnx._constants import ONNX_DEFAULT_OPSET

        return int(ONNX_DEFAULT_OPSET)
    except Exception:
        return NATIVE_OPSET


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def limits(version: tuple[int, int]) -> tuple[int, int] | None:
    """(max opset, max IR version) for an ONNX Runtime release; None before 1.0."""
    if version in ORT_MATRIX:
        return ORT_MATRIX[version]
    newest = max(ORT_MATRIX)
    if version > newest:
        return ORT_MATRIX[newest]
    return None


def export_opset(version: tuple[int, int]) -> int:
    """The opset to export at for that runtime: torch.onnx's default, or lower if the runtime
    cannot load it."""
    lim = limits(version)
    return min(default_opset(), lim[0]) if lim else default_opset()
