"""Fixes: changes onnxmedic makes to a captured program or an exported model so the next stage
succeeds, each keeping every value the model computes.

One protocol for all of them (like onnxscript's rewrite rules): ``check(subject)`` returns the
reason the fix does not apply (None when it does), and ``apply(subject)`` makes the change and
returns what it did. The reasons a fix did not apply go into the result (``not_applied`` in the
JSON report), so a reader sees what was tried.

- dtypes.DtypeRepair: casts around nodes ONNX Runtime has no kernel for, as typed (fix stage)
- opset.IrVersionFit: the IR version lowered to what an older ONNX Runtime loads (translate)
- custom_ops.CustomOpInlining: custom ops without a translation traced into ATen ops
- rewrites.REWRITES: program rewrites that avoid crashes of torch's decompositions
"""

from __future__ import annotations

from typing import Any, Protocol


class Fix(Protocol):
    """A fix: ``name`` says what it does; ``check`` why it does not apply (None: it does)."""

    name: str

    def check(self, subject: Any) -> str | None: ...

    def apply(self, subject: Any) -> Any: ...


def try_fix(fix: Fix, subject: Any, result: Any = None, *, check_on: Any = None) -> Any:
    """``fix.apply(subject)`` when ``fix.check`` finds nothing against it, else None, with the
    reason recorded on ``result`` (an ExportResult) when one is given. ``check_on``: what the
    check looks at, when not the subject itself (a rewrite checks the error, applies to the
    program)."""
    reason = fix.check(subject if check_on is None else check_on)
    if reason is not None:
        if result is not None:
            result.skip_reason(fix.name, reason)
        return None
    return fix.apply(subject)
