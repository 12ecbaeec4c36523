"""rewrite_speed.sibling_slices: onnxscript's optimizer gives the same graph with SlicesSplit
matched among one value's readers, and its rules are restored after the block."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
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


def _near_identity_model() -> onnx.ModelProto:
    """y = ((x + 1e-8) * 1.000005 - 1e-9) / 1.000001 + 0, then * 1: the last two are no-ops,
    the first four are not (an RMSNorm's epsilon of 1e-8, Helium's; scales near 1)."""
    consts = {"eps": 1e-8, "s": 1.000005, "e9": 1e-9, "d": 1.000001, "zero": 0.0, "one": 1.0}
    inits = [numpy_helper.from_array(np.array(v, dtype=np.float32), n) for n, v in consts.items()]
    nodes = [helper.make_node("Add", ["x", "eps"], ["a"]),
             helper.make_node("Mul", ["s", "a"], ["b"]),
             helper.make_node("Sub", ["b", "e9"], ["c"]),
             helper.make_node("Div", ["c", "d"], ["e"]),
             helper.make_node("Add", ["zero", "e"], ["f"]),
             helper.make_node("Mul", ["f", "one"], ["y"])]
    graph = helper.make_graph(
        nodes, "near", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_no_op_rules_remove_only_exact_zero_and_one():
    """onnxscript's own rules take 1e-8 for 0 and 1.000005 for 1 (math.isclose's default
    tolerances) and drop those ops; within sibling_slices only the exact + 0 and * 1 go."""
    proto = _near_identity_model()
    loose = [n.op_type for n in _optimized(proto, fast=False).graph.node]
    assert loose.count("Add") + loose.count("Mul") < 2  # onnxscript's: the epsilon is gone
    kept = _optimized(proto, fast=True)
    assert [n.op_type for n in kept.graph.node] == ["Add", "Mul", "Sub", "Div"]
    x = np.full(4, 3e-4, dtype=np.float32)
    import onnxruntime as ort

    got = ort.InferenceSession(kept.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = ((x.astype(np.float64) + 1e-8) * 1.000005 - 1e-9) / 1.000001
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert rewriter._DEFAULT_REWRITE_RULES[0]._target_pattern.output_nodes[0].inputs[
        1]._abs_tol > 0  # onnxscript's own rules are back after the block


class _RMSNorm(torch.nn.Module):
    """Helium's RMSNorm: float32 variance plus an epsilon of 1e-8, on activations of a
    model's scale (variance ~4e-4, where 1e-8 is 2.5e-5 of it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + 1e-8)


@pytest.mark.slow  # an export with its verification (~10 s); the rule's own test is above
def test_rmsnorm_epsilon_of_1e8_is_kept_and_verifies(tmp_path):
    """onnxmedic.export of an RMSNorm with eps 1e-8 verifies: without the exact no-op rules the
    optimizer dropped the epsilon and the output was refused (OM601, ~25x PyTorch's float32
    error)."""
    import onnxmedic

    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    res = onnxmedic.export(_RMSNorm().eval(), (x,), tmp_path / "rms.onnx")
    assert res.ok, [f.code for f in res.findings]
    adds = [n for n in onnx.load(tmp_path / "rms.onnx").graph.node if n.op_type == "Add"]
    assert adds, "the epsilon's Add was optimized away"
