"""The live line on stderr (report/live.py): shown while a long command runs, with what it is
doing, and off with --no-progress (export, optimize, sweep)."""

from __future__ import annotations

import io

from rich.console import Console

from onnxmedic import cli
from onnxmedic.report.live import live_line


def test_the_live_line_shows_its_description_and_updates():
    buf = io.StringIO()
    with live_line("optimize m.onnx (int8, cpu)", True,
                   console=Console(file=buf, force_terminal=True)) as show:
        show("optimize m.onnx: timing")
    assert "optimize m.onnx: timing" in buf.getvalue()
    with live_line("x", False) as show:
        assert show is None


def test_optimize_takes_no_progress_like_export():
    for command in (["optimize", "m.onnx", "m.py:M"], ["export", "m.py:M"]):
        assert cli.build_parser().parse_args(command + ["--no-progress"]).no_progress
        assert not cli.build_parser().parse_args(command).no_progress
