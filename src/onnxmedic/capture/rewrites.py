"""Rewrites of a captured program that keep its meaning and make the next stage succeed.

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

import torch

logger = logging.getLogger(__name__)

VIEW_CRASH = re.compile(r"Cannot view a tensor with shape|view size is not compatible with "
                        r"input tensor's size and stride", re.IGNORECASE)
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def check_view_crash(error: BaseException | None) -> str | None:
    """None when the rewrite applies to this decomposition error, else the reason it does not."""
    text = ""
    seen = set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text += f"\n{e}"
        e = e.__cause__ or e.__context__
    if not text:
        return "there is no error"
    if not VIEW_CRASH.search(text):
        return "the error is not a view of a non-contiguous tensor"
    return None


def contiguous_before_views(program: torch.export.ExportedProgram) -> int:
    """Insert ``aten.clone(x, memory_format=torch.contiguous_format)`` in front of every
    ``aten.view`` / ``aten.reshape`` of a computed tensor, in place; returns how many."""
    count = 0
    for gm in program.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _VIEWS:
                continue
            src = node.args[0]
            if not isinstance(src, torch.fx.Node) or src.op == "placeholder" or (
                    src.op == "call_function"
                    and src.target is torch.ops.aten.clone.default):
                continue
            with graph.inserting_before(node):
                clone = graph.call_function(torch.ops.aten.clone.default, (src,),
                                            {"memory_format": torch.contiguous_format})
            clone.meta = dict(src.meta)
            node.replace_input_with(src, clone)
            count += 1
        gm.recompile()
    return count
