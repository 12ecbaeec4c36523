"""The export pipeline: stages run in order, each reports when it starts, a stop leaves the
temporary folder removed."""

from __future__ import annotations

import io

import torch

import onnxmedic
from onnxmedic.pipeline import EXPORT_STAGES


def test_stages_run_in_order_and_report_as_they_start(tmp_path):
    seen: list[str] = []
    r = onnxmedic.export(torch.nn.Linear(3, 2), (torch.randn(2, 3),), tmp_path / "m.onnx",
                         on_stage=seen.append)
    assert r.ok
    assert seen == [s.name for s in EXPORT_STAGES]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".onnxmedic-")]


def test_a_failing_stage_stops_the_rest(tmp_path):
    class Broken(torch.nn.Module):
        def forward(self, x):
            return x @ torch.ones(5, 5)  # wrong inner size: preflight fails

    seen: list[str] = []
    r = onnxmedic.export(Broken(), (torch.randn(2, 3),), tmp_path / "m.onnx",
                         on_stage=seen.append)
    assert not r.ok and r.failed_stage == "preflight"
    assert seen == ["output", "plan", "preflight"]
    assert list(tmp_path.iterdir()) == []


def test_cli_stage_display_names_stage_and_size():
    from rich.console import Console

    from onnxmedic import cli

    buf = io.StringIO()
    with cli._stage_display(torch.nn.Linear(1024, 1024), enabled=True,
                            console=Console(file=buf, force_terminal=True)) as on_stage:
        on_stage("capture")
    assert "4 MiB of weights" in buf.getvalue() and "capture" in buf.getvalue()
    with cli._stage_display(torch.nn.Linear(2, 2), enabled=False) as on_stage:
        assert on_stage is None
