"""The export pipeline: the ordered stage list and the driver that runs it.

Each stage is a function of the ExportContext that records its own status and findings on the
result (``with result.stage(name) as st``) and returns whether the export goes on.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass

from onnxmedic.capture.stage import capture_stage
from onnxmedic.checks import save_and_check_stage
from onnxmedic.context import ExportContext
from onnxmedic.fixes.opset import plan_opset
from onnxmedic.fixes.stage import fix_stage
from onnxmedic.onnxfile import not_written_finding, output_stage, write_stage
from onnxmedic.preflight import first_call_state, preflight_stage
from onnxmedic.result import FAILED
from onnxmedic.translate import translate_stage
from onnxmedic.verify import ahead
from onnxmedic.verify.stage import expected_outputs, verify_stage


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline. ``notice``: when it fails, the model existed but is not
    written (OM010 says so, when an output path was given)."""

    name: str
    run: Callable[[ExportContext], bool]
    notice: bool = False


def _preflight(ctx: ExportContext) -> bool:
    """Run the model eagerly on the example inputs; its outputs are the reference the later
    stages compare with."""
    ctx.expected = preflight_stage(ctx.result, ctx.model, ctx.args, ctx.kwargs)
    if ctx.expected is not None:  # capture sees the state a plain call sees (OM125, OM126)
        first_call_state(ctx.result, ctx.model, ctx.state)
    return ctx.expected is not None


def _capture(ctx: ExportContext) -> bool:
    """Capture `ctx.model` as an ExportedProgram (capture/stage.py); then PyTorch's outputs on
    the input sets verification will draw start in a child, run while the model translates
    (verify/ahead.py)."""
    if not capture_stage(ctx):
        return False
    if ctx.opts.verify and ctx.program is not None and ctx.expected is not None:
        model = ctx.model
        ctx.ahead = ahead.start(model, ctx.example, ctx.program,
                                lambda s: expected_outputs(model, [s])[0], ctx.opts.timeout)
    return True


EXPORT_STAGES: tuple[Stage, ...] = (
    Stage("output", output_stage),  # the output path, before anything slow runs
    Stage("plan", plan_opset),  # the opset asked for against the runtime asked for
    Stage("preflight", _preflight),
    Stage("capture", _capture),
    Stage("translate", translate_stage),
    Stage("check", save_and_check_stage, notice=True),
    Stage("fix", fix_stage, notice=True),
    Stage("verify", verify_stage),  # runtime + compare (+ localisation)
    Stage("write", write_stage),
)


def run_export(ctx: ExportContext, stages: tuple[Stage, ...] = EXPORT_STAGES) -> None:
    """Run ``stages`` in order until one stops the export; the temporary folder the model was
    saved in, and the child computing input sets ahead, are removed whatever happens."""
    try:
        for stage in stages:
            if ctx.opts.on_stage is not None:
                ctx.opts.on_stage(stage.name)
            if stage.run(ctx):
                continue
            if (stage.notice and ctx.opts.f is not None
                    and ctx.result.stages.get(stage.name) == FAILED):
                ctx.result.findings.append(not_written_finding(ctx.opts.f))
            return
    finally:
        if ctx.ahead is not None:
            ctx.ahead.close()
        if ctx.tmp_dir is not None:
            shutil.rmtree(ctx.tmp_dir, ignore_errors=True)
