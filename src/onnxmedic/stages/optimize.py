"""The export pipeline's optional optimize stage (``export(..., optimize=True)``): after the
write, the verified file is optimized in place - replaced only by a faster verified variant."""

from __future__ import annotations

from dataclasses import fields

from onnxmedic.context import ExportContext


def optimize_wanted(ctx: ExportContext) -> bool:
    """Runs when asked for, and the export was verified and written."""
    return ctx.opts.optimize is not None and ctx.result.ok and bool(ctx.result.path)


def optimize_stage(ctx: ExportContext) -> bool:
    """Optimize the written file (onnxmedic.optimize.attach_to_export: ``result.optimization``
    and an OM720/OM721 finding); the export's own stages are done, so it always goes on."""
    from onnxmedic.optimize import attach_to_export

    request = ctx.opts.optimize
    assert request is not None
    if ctx.worker is not None:  # the export's own ONNX Runtime child is done
        ctx.worker.close()
    with ctx.result.timed("optimize"):
        attach_to_export(ctx.result, ctx.model, ctx.args, ctx.kwargs, timeout=ctx.opts.timeout,
                         **{f.name: getattr(request, f.name) for f in fields(request)})
    return True
