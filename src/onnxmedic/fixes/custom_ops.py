"""Custom-op inlining: a ``torch.library.custom_op`` without an ONNX translation whose Python
implementation is itself made of PyTorch ops is replaced by that implementation (traced by
``ExportedProgram.run_decompositions``), so torchlib can translate what it calls. An
implementation that leaves PyTorch (numpy, C++, data-dependent Python) cannot be traced; the op
then stays and is reported with the reason (a translation is the fix)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

_BUILTIN_NAMESPACES = {"aten", "prims", "higher_order", "_c10d_functional", "c10d", "quantized",
                       "onnx", "torchvision"}


@dataclass
class InlineResult:
    program: torch.export.ExportedProgram
    inlined: list[str] = field(default_factory=list)  # "ns::op"
    failed: dict[str, str] = field(default_factory=dict)  # "ns::op" -> reason


def _implementation(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    from onnxmedic._torch_compat import custom_op_implementation

    return custom_op_implementation(op)


def candidates(program: torch.export.ExportedProgram,
               translated: Any) -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """Custom ops in ``program`` with no translation (``op in translated`` is False) and a
    Python implementation."""
    found = {}
    for node in program.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if op.namespace in _BUILTIN_NAMESPACES or op in translated or op in found:
            continue
        impl = _implementation(op)
        if impl is not None:
            found[op] = impl
    return found


def inline_custom_ops(program: torch.export.ExportedProgram, translated: Any) -> InlineResult:
    """Inline every custom op that can be (all at once; one by one when that fails, so that
    one untraceable op does not block the others)."""
    todo = candidates(program, translated)
    result = InlineResult(program)
    if not todo:
        return result
    try:
        result.program = program.run_decompositions(dict(todo))
        result.inlined = sorted(op._schema.name for op in todo)
        return result
    except Exception as e:  # find which ones trace
        logger.debug("inlining all custom ops failed: %s", e)
    for op, impl in todo.items():
        name = op._schema.name
        try:
            result.program = result.program.run_decompositions({op: impl})
            result.inlined.append(name)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            result.failed[name] = f"{type(e).__name__}: {first}"
    return result


@dataclass
class CustomOpInlining:
    """A fix: custom ops with no translation replaced by their PyTorch implementation."""

    translated: Any
    name: str = "custom-op inlining"

    def check(self, program: torch.export.ExportedProgram) -> str | None:
        if not candidates(program, self.translated):
            return "no custom op without a translation has a Python implementation"
        return None

    def apply(self, program: torch.export.ExportedProgram) -> InlineResult:
        return inline_custom_ops(program, self.translated)
