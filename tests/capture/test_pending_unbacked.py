"""A program whose ops have data-dependent sizes decomposed twice (the translation again at a
lower opset, OM325): torch.onnx's passes leave the unbacked symbols of the first run pending in
the program's shape environment, and the second run used to fail binding them
(PendingUnbackedSymbolNotFound, reported as OM203 or OM202). onnxmedic drops them first."""

from __future__ import annotations

import pytest
import torch
from torch._guards import detect_fake_mode

from onnxmedic import _torch_compat
from onnxmedic.ops import REGISTRY


class Scatter(torch.nn.Module):
    """The positive entries doubled and written back by index (an unbacked count)."""

    def forward(self, x: torch.Tensor):
        idx = torch.where(x > 0)[0]
        return torch.zeros_like(x).index_copy(0, idx, x[idx] * 2), x[idx]


def _pending(program) -> list:
    mode = detect_fake_mode([n.meta.get("val") for n in program.graph.nodes
                             if n.op == "placeholder"])
    return list(mode.shape_env.pending_fresh_unbacked_symbols)


def test_a_program_decomposes_twice(monkeypatch) -> None:
    x = torch.randn(8, generator=torch.Generator().manual_seed(0))
    program = torch.export.export(Scatter(), (x,),
                                  dynamic_shapes=({0: torch.export.Dim("n")},))
    reg = REGISTRY.onnx_registry(None)
    _torch_compat.prepare_for_export(program, reg)
    assert _pending(program)  # what the first run leaves behind
    _torch_compat.prepare_for_export(program, reg)  # drops them first: no error
    assert _pending(program)  # and the second leaves its own
    # the fault, injected: without dropping them, the next run fails as it used to
    monkeypatch.setattr(_torch_compat, "forget_pending_unbacked", lambda p: None)
    with pytest.raises(Exception, match="PendingUnbackedSymbolNotFound|Pending unbacked"):
        _torch_compat.prepare_for_export(program, reg)
