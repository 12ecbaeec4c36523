"""onnxmedic: get any PyTorch model into ONNX Runtime, verified, or say exactly why not.

    import onnxmedic
    result = onnxmedic.export(model, (x,), "model.onnx")
    if not result.ok:
        for finding in result.findings:
            print(finding.one_paragraph())

The names below are imported on first use (PEP 562): ``import onnxmedic`` and the command
line start without torch.export, onnx-ir and the translations loaded, so that the command
line can start work that needs none of them (onnxruntime-genai's builder, hf/builder.py)
before loading them.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from onnxmedic.version import __version__

if TYPE_CHECKING:
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

# public name -> the module that defines it
_WHERE = {
    **dict.fromkeys(("ExportResult", "RunResult", "SweepResult", "VerifyResult", "ZooCase",
                     "doctor", "export", "localize", "reduce", "run", "sweep", "verify"),
                    "onnxmedic.api"),
    **dict.fromkeys(("CODES", "Finding", "Location", "Severity"), "onnxmedic.findings"),
    "export_pretrained": "onnxmedic.hf",
    "translation": "onnxmedic.ops",
    "bench": "onnxmedic.optimize",
    "optimize": "onnxmedic.optimize",
}

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


class _Package(types.ModuleType):
    """onnxmedic's module: a public function keeps its name when the submodule of the same
    name is imported (onnxmedic.doctor, .verify, .sweep, .optimize: the functions, as when
    this module imported them all at once; the submodules are in sys.modules)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """A public name (imported now, then kept), or a submodule (``onnxmedic.sandbox``)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
