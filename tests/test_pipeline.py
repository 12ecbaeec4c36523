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
    assert seen == [s.name for s in EXPORT_STAGES if s.wanted is None]  # optimize not asked
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
    with cli.stage_display(torch.nn.Linear(1024, 1024), enabled=True,
                            console=Console(file=buf, force_terminal=True)) as on_stage:
        on_stage("capture")
    assert "4 MiB of weights" in buf.getvalue() and "capture" in buf.getvalue()
    with cli.stage_display(torch.nn.Linear(2, 2), enabled=False) as on_stage:
        assert on_stage is None


def test_a_stage_runs_earlier_ones_again_only_as_declared():
    """A stage asks (ctx.rerun) and the driver runs again from the stage it declares: what
    those stages found is replaced by the request's finding; an undeclared request is a bug."""
    import pytest

    from onnxmedic.context import ExportContext, ExportOptions, Rerun
    from onnxmedic.findings import info
    from onnxmedic.pipeline import Stage, run_export
    from onnxmedic.result import ExportResult

    ran: list[str] = []

    def first(ctx):
        ran.append("first")
        ctx.result.findings.append(info("OM011", "first", f"run {ran.count('first')}"))
        return True

    def second(ctx):
        ran.append("second")
        if ran.count("second") == 1:
            ctx.result.findings.append(info("OM011", "second", "dropped"))
            ctx.rerun = Rerun("first", info("OM325", "second", "again"))
        return True

    def ctx():
        return ExportContext(ExportResult(command="export"), None, (), {}, ExportOptions())

    c = ctx()
    run_export(c, (Stage("first", first), Stage("second", second, reruns=("first",))))
    assert ran == ["first", "second", "first", "second"]
    assert [(f.code, f.message) for f in c.result.findings] == [("OM325", "again"),
                                                                ("OM011", "run 2")]
    ran.clear()
    with pytest.raises(RuntimeError, match="does not declare"):
        run_export(ctx(), (Stage("first", first), Stage("second", second)))


def test_the_stage_list_is_declared_once():
    """pipeline.EXPORT_STAGES runs the stages stages/__init__.py declares, in its order, and the
    statuses a result records are the ones that list says they record."""
    from onnxmedic.result import STAGES
    from onnxmedic.stages import EXPORT_STAGE_LIST

    assert [s.name for s in EXPORT_STAGES] == [name for name, _ in EXPORT_STAGE_LIST]
    assert STAGES == tuple(s for _, statuses in EXPORT_STAGE_LIST for s in statuses)
    assert STAGES == ("preflight", "capture", "translate", "check", "fix", "runtime", "compare",
                      "write")  # the JSON's keys of result.stages
