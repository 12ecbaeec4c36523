"""rewrite_speed.sibling_slices: onnxscript's optimizer gives the same graph with SlicesSplit
matched among one value's readers, and its rules are restored after the block."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxscript import optimizer, rewriter

from onnxmedic.rewrite_speed import RULE, sibling_slices


def _slices_model(layers: int) -> onnx.ModelProto:
    """Per layer: the halves of a [2, 8] tensor's last dim, a duplicate second half, and a
    first quarter. onnxscript's matcher returns the first Slice reading the same tensor in the
    graph's order, and the rule's check wants (first half, second half): the even layers, with
    the second half first, are rewritten to a Split, the odd ones are not."""
    inits = [numpy_helper.from_array(np.array(v, dtype=np.int64), n) for n, v in (
        ("k0", [0]), ("k4", [4]), ("k8", [8]), ("k2", [2]), ("ax", [-1]))]
    nodes, prev = [], "x"
    for i in range(layers):
        y = f"y{i}"
        halves = [helper.make_node("Slice", [y, "k0", "k4", "ax"], [f"a{i}"]),
                  helper.make_node("Slice", [y, "k4", "k8", "ax"], [f"b{i}"])]
        nodes += [helper.make_node("Relu", [prev], [y]), *halves[::1 if i % 2 else -1],
                  helper.make_node("Slice", [y, "k4", "k8", "ax"], [f"c{i}"]),
                  helper.make_node("Slice", [y, "k0", "k2", "ax"], [f"d{i}"]),
                  helper.make_node("Mul", [f"a{i}", f"b{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"c{i}"], [f"s{i}"]),
                  helper.make_node("Concat", [f"s{i}", f"s{i}"], [f"z{i}"], axis=-1),
                  helper.make_node("ReduceSum", [f"d{i}"], [f"r{i}"], keepdims=1),
                  helper.make_node("Add", [f"z{i}", f"r{i}"], [f"o{i}"])]
        prev = f"o{i}"
    graph = helper.make_graph(
        nodes, "slices", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _optimized(proto: onnx.ModelProto, fast: bool) -> onnx.ModelProto:
    model = ir.from_proto(proto)
    if fast:
        with sibling_slices():
            optimizer.optimize_ir(model)
    else:
        optimizer.optimize_ir(model)
    return ir.to_proto(model)


def test_same_graph_as_onnxscripts_matcher_and_rules_restored():
    proto = _slices_model(40)
    slow = _optimized(proto, fast=False)
    fast = _optimized(proto, fast=True)
    ops = [n.op_type for n in fast.graph.node]
    assert ops.count("Split") == 20
    assert ops == [n.op_type for n in slow.graph.node]
    assert [list(n.input) for n in fast.graph.node] == [list(n.input) for n in slow.graph.node]
    assert [r.name for r in rewriter._DEFAULT_REWRITE_RULES].count(RULE) == 1
    assert not any("Sibling" in type(r._matcher).__name__
                   for r in rewriter._DEFAULT_REWRITE_RULES)


class _Rewritable(torch.nn.Module):
    """A graph that onnxscript's default rules rewrite in several places: a Reshape chain, a
    Relu pair, a Transpose pair, Max then Min (a Clip), an Identity, Cast chains."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.relu(torch.relu(x.reshape(4, 8).reshape(2, 16)))
        b = a.transpose(0, 1).transpose(0, 1)
        c = torch.minimum(torch.maximum(b, torch.tensor(0.0)), torch.tensor(6.0))
        d = (c[..., :8] * c[..., 8:]).to(torch.float64).to(torch.float32)
        return d.unsqueeze(0).squeeze(0) + y.expand(2, 8)


def test_root_filter_gives_the_same_graph_and_tries_each_rule_on_its_op_only(monkeypatch):
    """Each rule behind RootFiltered: onnxscript's optimizer gives the same graph (the rules
    did rewrite it), and a rule is tried only on nodes of its pattern's root op - a few dozen
    tries instead of every rule on every node."""
    from onnxscript.rewriter import _rewrite_rule

    program = torch.onnx.export(_Rewritable().eval(), (torch.randn(2, 16), torch.randn(1, 8)),
                                dynamo=True, optimize=False, verbose=False)
    proto = ir.to_proto(program.model)
    tries = [0]
    try_rewrite = _rewrite_rule.RewriteRule.try_rewrite

    def counted(self, *args, **kwargs):
        tries[0] += 1
        return try_rewrite(self, *args, **kwargs)

    monkeypatch.setattr(_rewrite_rule.RewriteRule, "try_rewrite", counted)
    slow, slow_tries = _optimized(proto, fast=False), tries[0]
    tries[0] = 0
    fast, fast_tries = _optimized(proto, fast=True), tries[0]
    ops = [n.op_type for n in slow.graph.node]
    assert "Clip" in ops and ops.count("Relu") == 1 and "Transpose" not in ops
    assert len(ops) < len(proto.graph.node) // 2
    assert fast.graph == slow.graph
    assert fast_tries * 10 < slow_tries
    assert not any(type(r).__name__ == "RootFiltered" for r in rewriter._DEFAULT_REWRITE_RULES)
