"""The export pipeline: the ordered stage list and the driver that runs it.

Each stage is a function of the ExportContext that records its own status and findings on the
result (``with result.stage(name) as st``) and returns whether the export goes on.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass

from onnxmedic.context import ExportContext
from onnxmedic.onnxfile import not_written_finding
from onnxmedic.result import FAILED
from onnxmedic.stages import STAGE_NAMES
from onnxmedic.stages.capture import capture_stage
from onnxmedic.stages.check import save_and_check_stage
from onnxmedic.stages.fix import fix_stage
from onnxmedic.stages.optimize import optimize_stage, optimize_wanted
from onnxmedic.stages.output import output_stage
from onnxmedic.stages.plan import plan_opset
from onnxmedic.stages.preflight import export_preflight
from onnxmedic.stages.translate import translate_stage
from onnxmedic.stages.verify import verify_stage
from onnxmedic.stages.write import write_stage


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline. ``notice``: when it fails, the model existed but is not
    written (OM010 says so, when an output path was given). ``wanted``: an optional stage
    runs only where it says so (None: always). ``reruns``: the earlier stages this one may run
    again (``ctx.rerun``: from one of them up to itself; what they found is replaced)."""

    name: str
    run: Callable[[ExportContext], bool]
    notice: bool = False
    wanted: Callable[[ExportContext], bool] | None = None
    reruns: tuple[str, ...] = ()


_STAGES = (
    Stage("output", output_stage),  # the output path, before anything slow runs
    Stage("plan", plan_opset),  # the opset asked for against the runtime asked for
    Stage("preflight", export_preflight),
    Stage("capture", capture_stage),
    Stage("translate", translate_stage),
    Stage("check", save_and_check_stage, notice=True),
    # an op version ONNX Runtime has no kernel for, at the default opset: translated, checked
    # and fixed again at a lower one (OM325)
    Stage("fix", fix_stage, notice=True, reruns=("translate",)),
    Stage("verify", verify_stage),  # runtime + compare (+ localisation)
    Stage("write", write_stage),
    # optional, after the write: the verified file is replaced only by a faster verified one
    Stage("optimize", optimize_stage, wanted=optimize_wanted),
)
# in the order stages/__init__.py declares (a stage bound here but not declared there, or the reverse,
# fails at import)
EXPORT_STAGES: tuple[Stage, ...] = tuple({s.name: s for s in _STAGES}[name]
                                         for name in STAGE_NAMES)
if len(EXPORT_STAGES) != len(_STAGES):
    raise RuntimeError("pipeline.py binds a stage that stages.EXPORT_STAGE_LIST does not declare")


def run_export(ctx: ExportContext, stages: tuple[Stage, ...] = EXPORT_STAGES) -> None:
    """Run ``stages`` in order until one stops the export; the temporary folder the model was
    saved in is removed whatever happens."""
    try:
        at = 0
        while at < len(stages):
            stage = stages[at]
            at += 1
            if stage.wanted is not None and not stage.wanted(ctx):
                continue
            if ctx.opts.on_stage is not None:
                ctx.opts.on_stage(stage.name)
            ok = stage.run(ctx)
            if ctx.rerun is not None:
                at = _rerun(ctx, stages, stage)
                continue
            if ok:
                continue
            if (stage.notice and ctx.opts.f is not None
                    and ctx.result.stages.get(stage.name) == FAILED):
                ctx.result.findings.append(not_written_finding(ctx.opts.f))
            return
    finally:
        if ctx.tmp_dir is not None:
            shutil.rmtree(ctx.tmp_dir, ignore_errors=True)


def _rerun(ctx: ExportContext, stages: tuple[Stage, ...], stage: Stage) -> int:
    """Where the pipeline goes on after ``stage`` asked to run earlier stages again
    (``ctx.rerun``, from a stage it declares): the findings of the stages run again are
    replaced by the request's finding, and the index of the first of them is returned."""
    rerun, ctx.rerun = ctx.rerun, None
    assert rerun is not None
    names = [s.name for s in stages]
    if rerun.start not in stage.reruns:
        raise RuntimeError(f"stage {stage.name!r} asked to run {rerun.start!r} again, which "
                           f"it does not declare (Stage.reruns: {stage.reruns})")
    start = names.index(rerun.start)
    again = set(names[start:names.index(stage.name) + 1])
    ctx.result.findings[:] = [f for f in ctx.result.findings if f.stage not in again]
    ctx.result.findings.append(rerun.finding)
    return start
