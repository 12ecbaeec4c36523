"""Integer outputs selected by ranking float values (top-k indices, argmax, NMS keep) are judged
against the float64 run where PyTorch's own float32 ranking is unstable; an exact integer
computation, a stable ranking, and an index neither run picked stay mismatches
(verify/ranking.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from onnxmedic.verify.compare import compare_outputs
from onnxmedic.verify.ranking import RULE_RANKING_F64, ranked_outputs, rejudge_rankings


def test_ranked_outputs_come_from_the_graph() -> None:
    """TopK indices and an ArgMax (also through a Gather and a Cast) are ranked; an integer
    sum of the inputs is an exact computation."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 10])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, [2, 10])
    outs = [helper.make_tensor_value_info(n, TensorProto.INT64, shape) for n, shape in
            (("top", [2, 3]), ("best", [2]), ("sum", [2, 10]), ("picked", [2, 3]))]
    k = helper.make_tensor("k", TensorProto.INT64, [1], [3])
    nodes = [helper.make_node("TopK", ["x", "k"], ["vals", "top"]),
             helper.make_node("ArgMax", ["x"], ["best"], axis=1),
             helper.make_node("Add", ["i", "i"], ["sum"]),
             helper.make_node("GatherElements", ["i", "top"], ["g"], axis=1),
             helper.make_node("Cast", ["g"], ["picked"], to=TensorProto.INT64)]
    m = helper.make_model(helper.make_graph(nodes, "g", [x, i], outs, [k]))
    onnx.checker.check_model(m)
    assert ranked_outputs(m, 4) == ["set", "order", None, "set"]
    assert ranked_outputs(None, 1) == [None]


def _judge(exp, act, ref, ranked: str | None = "set") -> tuple[bool, str, list[int]]:
    comps = compare_outputs(["idx"], [exp], [act])
    asked: list[int] = []
    rejudge_rankings([exp], [act], comps, [ranked], lambda: asked.append(1) or [ref])
    return comps[0].ok, comps[0].rule, asked


def test_unstable_ranking_judged_against_float64_and_faults_caught() -> None:
    ref = np.array([7, 3, 5, 1, 9, 0], np.int64)  # the float64 run's top-6
    torch32 = np.array([3, 7, 5, 1, 9, 2], np.int64)  # near ties flipped by float32, 0 <-> 2
    ok, rule, asked = _judge(torch32, ref, ref)
    assert ok and rule == RULE_RANKING_F64 and asked == [1]  # ONNX Runtime gets float64's
    assert _judge(torch32, np.array([7, 3, 1, 5, 9, 4]), ref)[0]  # other near ties
    # injected faults: more items float64 does not pick than float32 has, an index off
    assert not _judge(torch32, np.array([7, 3, 1, 5, 8, 4]), ref)[0]
    order32 = np.array([3, 7, 5, 1, 9, 0], np.int64)  # float32 flips the order only
    assert _judge(order32, np.array([7, 3, 5, 1, 0, 9]), ref)[0]
    assert not _judge(order32, np.array([1007, 3, 5, 1, 9, 0]), ref)[0]
    # a choice per element (argmax per row): as many differing rows as float32, no more
    rows32 = np.array([3, 1, 2, 2, 0, 4], np.int64)  # row 0 flipped
    ref_rows = np.array([1, 1, 2, 2, 0, 4], np.int64)
    assert _judge(rows32, np.array([1, 1, 2, 2, 0, 4]), ref_rows, "order")[0]
    assert not _judge(rows32, np.array([1, 2, 1, 2, 0, 4]), ref_rows, "order")[0]
    assert not _judge(torch32, ref[::-1].copy(), ref, "order")[0]  # reversed order
    # PyTorch's float32 ranking is stable: no excuse, any difference is a mismatch
    ok, rule, asked = _judge(ref, torch32, ref)
    assert not ok and rule != RULE_RANKING_F64 and asked == [1]
    # an exact integer computation: never rejudged, the float64 run not even asked
    ok, _, asked = _judge(torch32, ref, ref, ranked=None)
    assert not ok and asked == []


def test_matching_outputs_do_not_run_float64() -> None:
    ref = np.array([1, 2, 3], np.int64)
    ok, _, asked = _judge(ref, ref.copy(), ref)
    assert ok and asked == []


class _TopK(torch.nn.Module):
    """Top-8 indices of scores whose float32 rounding (x + 1e5 - 1e5: steps of 1/128) turns
    near ties into ties."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x + 1e5) - 1e5).topk(8).indices


@pytest.mark.slow  # 24 s: an export, and a verify that localises the fault
def test_topk_model_verifies_and_a_wrong_index_is_caught(tmp_path) -> None:
    """End to end: a top-k over scores float32 rounds into near ties exports and verifies; an
    index shifted in the ONNX model (an index neither run picks) is caught even though
    PyTorch's own float32 ranking differs from the float64 one."""
    import onnxmedic
    from onnxmedic.verify import faults

    model = _TopK().eval()
    x = torch.rand(512, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert not torch.equal(model(x), model.double()(x.double()))  # unstable in float32
    model.float()
    path = tmp_path / "topk.onnx"
    res = onnxmedic.export(model, (x,), path)
    assert res.ok, [(f.code, f.message[:300]) for f in res.findings]
    proto = onnx.load(path)
    bad = faults.shift_first_row(proto, proto.graph.output[0].name, 1000)
    onnx.save(bad, tmp_path / "bad.onnx")
    r = onnxmedic.verify(tmp_path / "bad.onnx", model, (x,))
    assert not r.ok and "OM601" in [f.code for f in r.findings]
