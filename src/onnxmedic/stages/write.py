"""The write stage: the verified model published to the destination atomically (the check stage
saved it to a temporary folder beside it)."""

from __future__ import annotations

from typing import Any

from onnxmedic.findings import warning
from onnxmedic.onnxfile import not_written_finding, publish


def write_stage(ctx: Any) -> bool:
    """Publish the verified model (or, with keep_unverified, the unverified one, said so) to
    the destination atomically; otherwise say it was not written."""
    result, dest = ctx.result, ctx.dest
    if dest is None:
        return True
    if not (ctx.verified or ctx.opts.keep_unverified):
        result.findings.append(not_written_finding(ctx.opts.f))
        return True
    with result.stage("write"):
        publish(ctx.tmp_dir, ctx.name, dest)
    result.path = str(dest)
    if not ctx.verified:
        result.findings.append(warning(
            "OM010", "write", f"{dest} was written although verification failed "
            "(keep_unverified=True)."))
    return True
