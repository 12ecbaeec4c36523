"""The output stage: the output path checked before anything slow runs."""

from __future__ import annotations

from typing import Any

from onnxmedic.onnxfile import check_output_path


def output_stage(ctx: Any) -> bool:
    """Fail fast, before the slow stages, when the output path cannot be written."""
    bad = check_output_path(ctx.opts.f)
    if bad is not None:
        ctx.result.fail("write", bad)
    return bad is None
