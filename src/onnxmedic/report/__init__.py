"""Reports: terminal (rich), JSON, self-contained HTML (jinja2), repro script."""

from __future__ import annotations

from onnxmedic.report.files import write_report
from onnxmedic.report.terminal import render_terminal

__all__ = ["render_terminal", "write_report"]
