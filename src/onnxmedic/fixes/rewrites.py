"""Rewrites of a captured program that keep its meaning and make the next stage succeed.

Each is a pass with a ``check(error)`` that returns the reason it does not apply (None when it
does) and an ``apply(program)`` that rewrites in place and returns how many nodes it changed.

``contiguous_before_views``: torch's decompositions (run by torch.onnx) re-trace the program
with symbolic shapes, and ``aten.reshape`` / ``aten.view`` of a transposed tensor - Hugging
Face attention's ``attn_output.transpose(1, 2).reshape(b, s, -1)`` in T5, Swin, XLNet ... - can
then be lowered to a ``view`` that fake-tensor stride propagation rejects ("Cannot view a
tensor with shape ... and strides ..."), although eager PyTorch runs it. A contiguous
``clone`` in front of each view/reshape makes the strides provably viewable; in ONNX, which
has no strides, the clone is an Identity the optimiser removes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

VIEW_CRASH = re.compile(r"Cannot view a tensor with shape|view size is not compatible with "
                        r"input tensor's size and stride", re.IGNORECASE)
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def _chain_text(error: BaseException | None) -> str:
    text = ""
    seen = set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text += f"\n{e}"
        e = e.__cause__ or e.__context__
    return text


def _error_check(pattern: re.Pattern[str], reason: str) -> Any:
    """A rewrite's check: None when the decomposition error matches ``pattern``, else why not."""
    def check(error: BaseException | None) -> str | None:
        text = _chain_text(error)
        if not text:
            return "there is no error"
        return None if pattern.search(text) else reason
    return check


# a view of a non-contiguous tensor inside a decomposition (T5, BEiT, Swin)
check_view_crash = _error_check(VIEW_CRASH, "the error is not a view of a non-contiguous tensor")


def _calls(program: torch.export.ExportedProgram, match: Any) -> Any:
    """(graph, node) for every call_function node whose target ``match`` accepts, in every
    graph module of ``program``; each module is recompiled once its nodes are done."""
    for gm in program.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and match(node.target):
                yield gm.graph, node
        gm.recompile()


def contiguous_before_views(program: torch.export.ExportedProgram) -> int:
    """Insert ``aten.clone(x, memory_format=torch.contiguous_format)`` in front of every
    ``aten.view`` / ``aten.reshape`` of a computed tensor, in place; returns how many."""
    count = 0
    for graph, node in _calls(program, lambda t: t in _VIEWS):
        src = node.args[0]
        if not isinstance(src, torch.fx.Node) or src.op == "placeholder" or (
                src.op == "call_function" and src.target is torch.ops.aten.clone.default):
            continue
        with graph.inserting_before(node):
            clone = graph.call_function(torch.ops.aten.clone.default, (src,),
                                        {"memory_format": torch.contiguous_format})
        clone.meta = dict(src.meta)
        node.replace_input_with(src, clone)
        count += 1
    return count


RSUB_CRASH = re.compile(r"Cannot find a compatible OpOverload for aten\.sub.*?"
                        r"target=torch\.ops\.aten\.sub\.Tensor\]\(args = \(-?[\d.e+-]+,",
                        re.DOTALL)


# the decomposition of aten.rsub.Scalar (1.0 - mask in XLNet) produces aten.sub.Tensor(1.0, x),
# which no overload accepts
check_rsub_crash = _error_check(RSUB_CRASH, "the error is not the decomposition of rsub(scalar)")


def rsub_as_add(program: torch.export.ExportedProgram) -> int:
    """Rewrite ``aten.rsub.Scalar(x, other, alpha)`` (= other - alpha * x) as
    ``aten.add.Tensor(aten.neg(x), other)`` (times alpha when it is not 1), in place."""
    count = 0
    for graph, node in _calls(program, lambda t: t is torch.ops.aten.rsub.Scalar):
        x, other = node.args[0], node.args[1]
        alpha = node.args[2] if len(node.args) > 2 else node.kwargs.get("alpha", 1)
        with graph.inserting_before(node):
            neg = graph.call_function(torch.ops.aten.neg.default, (x,))
            neg.meta = dict(node.meta)
            if alpha != 1:
                neg = graph.call_function(torch.ops.aten.mul.Tensor, (neg, alpha))
                neg.meta = dict(node.meta)
            new = graph.call_function(torch.ops.aten.add.Tensor, (neg, other))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    return count


@dataclass(frozen=True)
class Rewrite:
    """A program rewrite as a fix: ``check(error)`` says why it does not apply to that
    decomposition error; ``apply(program)`` rewrites in place and returns the nodes changed."""

    code: str  # the finding that reports it
    name: str
    check: Callable[[BaseException | None], str | None]
    apply: Callable[[torch.export.ExportedProgram], int]
    what: str  # "{n}" is replaced by the count


REWRITES: tuple[Rewrite, ...] = (
    Rewrite("OM122", "rewrite: contiguous before views", check_view_crash,
            contiguous_before_views, "made the input of {n} view/reshape op(s) contiguous"),
    Rewrite("OM123", "rewrite: rsub as add", check_rsub_crash, rsub_as_add,
            "rewrote {n} rsub(x, scalar) as add(neg(x), scalar)"),
)
