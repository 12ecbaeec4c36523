"""onnxmedic's version, in a module that imports nothing, so that any module can read it without
importing the package's facade (report/repro.py did, which closed the import cycle
onnxmedic -> api -> reduction -> report.repro -> onnxmedic)."""

from __future__ import annotations

__version__ = "0.1.0"
