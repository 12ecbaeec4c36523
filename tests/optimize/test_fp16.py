"""--precision fp16: ONNX Runtime's float16 converter with a measured block list (OM724)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import onnxmedic
from onnxmedic.optimize import (
    Why,
    block_list_findings,
    candidates,
    files,
    fp16,
    fp16_search,
    judge_reduced,
    optimize,
    passes,
    reference_sets,
)

FAST = {"repeats": 3, "rounds": 1}
FP16 = [p for p in passes.default_pipelines(precision="fp16") if p.name == "fp16"]


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 8)


class Overflow(_TwoLayers):
    """An intermediate scaled past float16's 65504 and back down: harmless in float32. In
    float16 the product overflows on a GPU's float16 kernels; on ONNX Runtime's CPU provider,
    which runs float16 nodes in float32 behind Casts, the converter's clipping of the 1e5
    constant to 65504 already changes the result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.relu(h * 1e5) * 1e-5 + h)


class Underflow(_TwoLayers):
    """An intermediate scaled below float16's smallest normal (6.1e-05) and back up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x) * 1e-7) * 1e7)


def _export(model: torch.nn.Module, x: torch.Tensor, path: Path) -> Path:
    torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
    return path


def _names(path: Path, ops: set[str]) -> set[str]:
    return {n.name for n in onnx.load(str(path)).graph.node if n.op_type in ops}


def _without_block_list(model: torch.nn.Module, x: torch.Tensor, tmp_path: Path
                        ) -> tuple[Path, Path, tuple[bool, dict[str, Any], str]]:
    """The export, the graph the converter sees (onnxscript's optimizer) and the verdict on
    that graph in float16 with no block list (``judge_reduced`` on the export's input sets)."""
    src = _export(model, x, tmp_path / "m.onnx")
    feeds, expected, _, _ = reference_sets(src, model, onnxmedic.inputs.Inputs((x,)))
    pre = tmp_path / "pre.onnx"
    passes.onnxscript_optimize(str(src), str(pre))
    fp16.float16(str(pre), str(tmp_path / "plain16.onnx"), node_block_list=[])
    sbx = onnxmedic.sandbox.run_model(tmp_path / "plain16.onnx", feeds)
    assert sbx.ok
    return src, pre, judge_reduced(["y"], expected, sbx.outputs)


def test_fp16_overflows_without_the_block_list_and_verifies_with_it(tmp_path: Path) -> None:
    model = Overflow().eval()
    x = torch.randn(4, 16) * 4
    with torch.no_grad():
        assert (model.a(x).abs() * 1e5).max() > 65504  # the intermediate float16 cannot hold
    src, pre, (ok, acc, why) = _without_block_list(model, x, tmp_path)
    assert not ok and "cosine" in why and acc["y"]["cosine"] < 0.999

    res = optimize(src, model, (x,), precision="fp16", pipelines=FP16, **FAST)
    v = res.variants[1]
    assert v.name == "fp16" and v.precision == "fp16"
    assert v.verified, v.rejected
    # the Mul that overflows (and reads the 1e5), the Relu that reads it, the Mul that reads
    # the Relu's output and scales it back
    assert set(v.blocked) == _names(pre, {"Mul", "Relu"}) and len(v.blocked) == 3
    relu = _names(pre, {"Relu"}).pop()
    assert v.blocked[relu].startswith("reads ") and "> 65504" in v.blocked[relu]
    mul = sorted(_names(pre, {"Mul"}))[0]
    assert v.worst_cosine() >= 0.999
    assert v.steps[-1]["blocked"] == sorted(v.blocked)
    (f,) = block_list_findings(res)
    assert f.code == "OM724" and set(f.details["nodes"]) == set(v.blocked)
    assert mul in f.message and "65504" in f.message


def test_fp16_underflow_is_blocked_too(tmp_path: Path) -> None:
    model = Underflow().eval()
    x = torch.randn(4, 16)
    src, pre, (ok, _, _) = _without_block_list(model, x, tmp_path)
    assert not ok

    res = optimize(src, model, (x,), precision="fp16", pipelines=FP16, **FAST)
    v = res.variants[1]
    assert v.verified, v.rejected
    # the Mul by 1e-7, the Tanh that reads it, the Mul by 1e7 that reads the Tanh
    assert set(v.blocked) == _names(pre, {"Mul", "Tanh"}) and len(v.blocked) == 3
    tanh = _names(pre, {"Tanh"}).pop()
    assert "underflows" in v.blocked[tanh]  # the 1e7 that scales it back is over 65504
    assert all("underflows" in r or "> 65504" in r for r in v.blocked.values())


def test_range_stats_in_chunks_measures_the_same(tmp_path: Path) -> None:
    model = Overflow().eval()
    x = torch.randn(4, 16) * 4
    src = _export(model, x, tmp_path / "m.onnx")
    npz = files.save_feeds([{"x": x.numpy()}, {"x": -x.numpy()}], tmp_path / "f.npz")
    whole = fp16.range_stats(str(src), "", str(npz))["values"]
    split = fp16.range_stats(str(src), "", str(npz), chunk_bytes=1)["values"]  # one a run
    assert whole == split
    outs = {o for n in onnx.load(str(src)).graph.node for o in n.output}
    assert outs <= set(whole) and "x" in whole  # every node output and the input
    with torch.no_grad():
        h = model.a(x)
    mul = next(n.output[0] for n in onnx.load(str(src)).graph.node if n.op_type == "Mul")
    assert whole[mul][0] == pytest.approx(float(h.abs().max()) * 1e5, rel=1e-5)


def test_a_few_tiny_values_in_a_large_tensor_do_not_block() -> None:
    """A softmax's far tail: many elements below 6.1e-05 but almost none of the magnitude."""
    p = np.full(1000, 1e-9, np.float32)
    p[0] = 1.0
    assert fp16.value_problem(fp16.value_stats(p)) == ""
    assert "underflows" in fp16.value_problem(fp16.value_stats(np.full(10, 1e-6, np.float32)))
    assert "65504" in fp16.value_problem(fp16.value_stats(np.array([1.0, -7e4], np.float32)))
    assert fp16.value_problem(fp16.value_stats(np.array([65504.0, np.inf], np.float32))) == ""


def test_round_trips_are_bypassed_but_a_models_own_casts_are_not() -> None:
    F, H, I32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=H, name="to16"),
             helper.make_node("Cast", ["h"], ["f"], to=F, name="to32"),  # float->16->float
             helper.make_node("Cast", ["x"], ["i"], to=I32, name="toint"),
             helper.make_node("Cast", ["i"], ["g"], to=F, name="back"),  # float->int->float
             helper.make_node("Add", ["f", "g"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2])],
                          [helper.make_tensor_value_info("y", F, [2])],
                          value_info=[helper.make_tensor_value_info("h", H, [2]),
                                      helper.make_tensor_value_info("i", I32, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    assert fp16.drop_round_trips(model) == 1
    ops = {n.name: (n.op_type, list(n.input)) for n in model.graph.node}
    assert ops["to32"] == ("Identity", ["x"]) and "to16" not in ops  # unused: removed
    assert ops["back"] == ("Cast", ["i"]) and ops["toint"] == ("Cast", ["x"])


def test_judge_reduced_fails_non_finite_outputs() -> None:
    e = [[np.array([1.0, 2.0, 3.0], np.float32)]]
    ok, acc, why = judge_reduced(["y"], e, [[np.array([1.0, np.inf, 3.0], np.float32)]])
    assert not ok and "non-finite" in why and acc["y"]["nonfinite"] == 1
    ok, _, why = judge_reduced(["y"], e, [[np.array([1.0, np.nan, 3.0], np.float32)]])
    assert not ok


def test_export_optimize_fp16_reports_the_block_list(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:

    # the fp16 candidate only (the float32 ones are tested elsewhere)
    monkeypatch.setattr(candidates, "default_pipelines", lambda *a, **k: FP16)
    out = tmp_path / "m.onnx"
    res = onnxmedic.export(Overflow(), (torch.randn(4, 16) * 4,), out, optimize=True,
                           precision="fp16")
    assert res.ok and res.optimization is not None
    v = res.optimization.variants[1]
    assert v.name == "fp16" and v.verified and len(v.blocked) == 3
    om724 = [f for f in res.findings if f.code == "OM724"]
    assert om724 and set(om724[0].details["nodes"]) == set(v.blocked)


class Plain(_TwoLayers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_variant_outside_only_the_accuracy_budget_is_timed_but_never_chosen(
        tmp_path: Path) -> None:
    """float16 rounding (cosine ~0.9999995) against a budget of 0.99999999: the variant is
    rejected for accuracy, yet timed beside the others so that the report gives its speed."""
    model = Plain().eval()
    x = torch.randn(8, 16)
    src = _export(model, x, tmp_path / "m.onnx")
    res = optimize(src, model, (x,), precision="fp16", accuracy="cosine=0.99999999",
                   pipelines=FP16, **FAST)
    v = res.variants[1]
    assert not v.verified and v.rejected.startswith("outside the accuracy budget")
    assert 0.999 < v.worst_cosine() < 0.99999999
    assert v.median_ms is not None and v.speedup is not None  # timed
    assert res.chosen == "plain"


def test_a_faster_near_miss_names_the_budget_that_would_admit_it() -> None:
    from onnxmedic.optimize import Variant
    from onnxmedic.optimize.candidates import budget_hint

    v = Variant("int8-static", precision="int8", speedup=3.04,
                accuracy={"y": {"cosine": 0.99696}, "z": {"cosine": 0.9999}})
    hint = budget_hint(v)
    assert "3.04x faster" in hint and "`--accuracy cosine=0.996`" in hint and "0.99696" in hint
    assert budget_hint(Variant("slow", precision="int8", speedup=0.8,
                                accuracy={"y": {"cosine": 0.99696}})) == ""
    assert budget_hint(Variant("lost", precision="int8", speedup=3.0,
                                accuracy={"y": {"cosine": 0.0004}})) == ""


class Normalize(torch.nn.Module):
    """F.normalize of a projection, one row of it masked to zero (sentence-transformers'
    normalised mean pooling over an all-padding sequence): its norm 0 is clamped to eps=1e-12
    and the row divided by it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.proj(x) * keep, p=2, dim=1)


def test_fp16_keeps_a_divisor_that_underflows_in_float32(tmp_path: Path) -> None:
    """A divisor with one element below float16's range breaks the quotient, though that
    element carries no share of its magnitude (the underflow rule's measure). Here the
    underflow rule kept the clamp (it reads the 1e-12) in float32, whose output 1e-12 was then
    cast to float16 - 0 - and divided: 0 / 0 = NaN on the zero row (found on the ecosystem
    zoo's sentence-transformers mean pooling). The divisor's producer and the Div stay float32
    too now; the value's other readers do not have to."""
    model = Normalize().eval()
    x, keep = torch.randn(3, 16), torch.ones(3, 1)
    keep[1] = 0
    src = tmp_path / "m.onnx"
    torch.onnx.export(model, (x, keep), str(src), dynamo=True, verbose=False)
    res = optimize(src, model, (x, keep), precision="fp16", pipelines=FP16, **FAST)
    v = res.variants[1]
    assert v.verified and v.worst_cosine() >= 0.999, v.rejected
    pre = tmp_path / "pre.onnx"
    passes.onnxscript_optimize(str(src), str(pre))
    (div,) = _names(pre, {"Div"})
    assert v.blocked[div].startswith("divides by ") and "8 of its 24 nonzero" in v.blocked[div]
    assert any("a divisor that has" in why for why in v.blocked.values())


def _untypable(path: Path) -> Path:
    """A blocked com.microsoft node (Gelu: ONNX's inference leaves its output untyped) whose
    output reaches a float16 Transpose through a Reshape, and a ReduceMax with its axes as an
    input feeding a Where - on which ONNX Runtime's symbolic shape inference raises."""
    nodes = [
        helper.make_node("Mul", ["x", "big"], ["a"], name="scale_up"),
        helper.make_node("Gelu", ["a"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("Mul", ["g", "small"], ["s"], name="scale_down"),
        helper.make_node("Reshape", ["s", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[1, 0]),
        helper.make_node("ReduceMax", ["x", "axes"], ["mx"], name="rmax", keepdims=1),
        helper.make_node("Cast", ["mx"], ["mb"], name="cast", to=TensorProto.BOOL),
        helper.make_node("Where", ["mb", "t", "zero"], ["y"], name="where"),
    ]
    inits = [helper.make_tensor("big", TensorProto.FLOAT, [], [1e5]),
             helper.make_tensor("small", TensorProto.FLOAT, [], [1e-5]),
             helper.make_tensor("shape", TensorProto.INT64, [2], [4, 4]),
             helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
             helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     [4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])], inits,
                          value_info=[helper.make_tensor_value_info("t", TensorProto.FLOAT,
                                                                    [4, 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                                  helper.make_opsetid("com.microsoft", 1)]),
              str(path))
    return path


def test_blocked_nodes_are_cast_back_where_symbolic_inference_fails(tmp_path: Path) -> None:
    """The converter casts a blocked node's output to float16 only where the output is typed:
    symbolic shape inference raising left the fused op's output untyped, so the float32 value
    reached a Transpose declared float16 and ONNX Runtime refused the file ("Type Error"; a
    padded BERT's fused attention blocked by its mask, MoE models). ONNX Runtime types it now."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    src = _untypable(tmp_path / "m.onnx")
    with pytest.raises(TypeError):  # the upstream failure this is about
        SymbolicShapeInference.infer_shapes(onnx.load(str(src)), auto_merge=True,
                                            guess_output_rank=False)
    info = fp16.float16(str(src), str(tmp_path / "h.onnx"),
                        node_block_list=["scale_up", "gelu", "scale_down"])
    assert info["blocked"] == ["scale_up", "gelu", "scale_down"]
    x = np.random.default_rng(0).random((4, 4), dtype=np.float32)
    sbx = onnxmedic.sandbox.run_model(tmp_path / "h.onnx", [{"x": x}])
    assert sbx.ok, sbx.summary()
    ref = onnxmedic.sandbox.run_model(src, [{"x": x}])
    np.testing.assert_allclose(sbx.outputs[0][0], ref.outputs[0][0], rtol=2e-3, atol=1e-4)
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in onnx.load(str(tmp_path / "h.onnx")).graph.value_info}
    assert types["t"] == TensorProto.FLOAT16  # the Transpose itself runs in float16


class MaskedAttention(torch.nn.Module):
    """Attention with transformers' additive padding mask: (1 - mask) * finfo(float32).min."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) * 2.0
        bias = (1.0 - mask[:, None, :].float()) * torch.finfo(torch.float32).min
        return torch.softmax(scores + bias, dim=-1) @ self.v(x)


def _masked(mask: torch.Tensor, tmp_path: Path) -> tuple[Any, Path]:
    model = MaskedAttention().eval()
    x = torch.randn(2, 8, 16)
    src = tmp_path / "m.onnx"
    torch.onnx.export(model, (x, mask), str(src), dynamo=True, verbose=False)
    res = optimize(src, model, (x, mask), precision="fp16", pipelines=FP16, **FAST)
    return res, src


def test_mask_fill_values_saturate_in_float16_instead_of_blocking(tmp_path: Path) -> None:
    """A padding mask's finfo.min is 'over 65504' only in its fill values: kept float32 it
    blocked every node reading the mask (the softmax here; a fused attention in BERT/GPT-2).
    Saturated to -65504 in float16 the masked scores still vanish: no node blocked, verified,
    the values named (OM727)."""
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 6:] = 0  # padding: no query row is fully masked, in any permutation of it
    res, _ = _masked(mask, tmp_path)
    v = res.variants[1]
    assert v.verified, v.rejected
    assert v.blocked == {} and v.saturation_rejected == ""
    assert v.saturated and all("only in fill values" in r and "3.403e+38" in r
                               for r in v.saturated.values())
    (f,) = block_list_findings(res)
    assert f.code == "OM727" and set(f.details["values"]) == set(v.saturated)
    assert "saturate" in f.message


def test_fill_values_that_change_the_result_are_kept_float32(tmp_path: Path) -> None:
    """A fully masked row: in float32 finfo.min absorbs every score (a uniform softmax), while
    -65504 in float16 does not (softmax of the scores): the saturating variant fails its
    budget, so the strict block list is built and verified instead, and OM727 says why."""
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :] = 0
    res, _ = _masked(mask, tmp_path)
    v = res.variants[1]
    assert v.verified, v.rejected
    assert v.saturated == {} and v.blocked
    assert any("softmax" in n.lower() for n in v.blocked)
    assert v.saturation_rejected.startswith("leaving ")
    assert "outside the accuracy budget" in v.saturation_rejected
    codes = {f.code: f for f in block_list_findings(res)}
    assert set(codes) == {"OM724", "OM727"}
    assert "kept in float32 instead" in codes["OM727"].message


def test_fill_statistics() -> None:
    mask = np.array([0.5, -3.4028235e38, 2.0, -1e9], np.float32)
    st = fp16.value_stats(mask)
    assert "65504" in fp16.value_problem(st)  # the strict rule
    assert fp16.value_problem(st, saturate=True) == ""
    assert "within 2" in fp16.fill_problem(st)
    big = np.array([0.5, 7e4, -3.4e38], np.float32)  # a computed 7e4 beside the fill
    assert "65504" in fp16.value_problem(fp16.value_stats(big), saturate=True)
    assert fp16.fill_problem(fp16.value_stats(big)) == ""
    # the underflow share is of the computed elements' magnitude, not the fill's
    tiny = np.array([1e-6] * 10 + [-3.4e38], np.float32)
    assert "underflows" in fp16.value_problem(fp16.value_stats(tiny), saturate=True)
    assert fp16.saturated({"m": st, "b": fp16.value_stats(big)}) == {"m": fp16.fill_problem(st)}


class Cancellation(torch.nn.Module):
    """A value of magnitude 1000 that a Sub cancels back down to h's (about 0.5): float16
    keeps 1000 + h to 2**-11 of 1000, so h to about 0.25. Harmless in float32, and nothing
    float16 cannot hold (no overflow, no underflow) - the range rule keeps nothing. The
    Concat and Slice between the Add and the Sub have float16 kernels on ONNX Runtime's CPU
    provider, so the 1000 + h it hands them is really float16 here too (a plain
    ``(h + 1000) - 1000`` runs in float32 on the CPU, and fails only on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + 1000.0
        return self.b(torch.cat([h, h], 1)[:, 3:67] - 1000.0)


def test_nodes_that_amplify_float16_error_stay_float32(tmp_path: Path) -> None:
    model = Cancellation().eval()
    x = torch.randn(8, 64)
    src, pre, (ok, acc, _) = _without_block_list(model, x, tmp_path)
    assert not ok and acc["y"]["cosine"] < 0.99  # the fault: float16 alone fails the budget

    res = optimize(src, model, (x,), precision="fp16", pipelines=FP16, **FAST)
    v = res.variants[1]
    assert v.verified, v.rejected
    assert v.worst_cosine() >= 0.999
    sub = _names(pre, {"Sub"}).pop()
    # the Sub that amplifies, with the chain that carries the 1000 + h it cancels; never the
    # Linear layers, which float16 computes well
    assert set(v.blocked) == _names(pre, {"Sub", "Slice", "Concat", "Add"})
    assert v.blocked[sub].startswith("adds float16 error")
    assert all(r.startswith(f"feeds {sub}") for n, r in v.blocked.items() if n != sub)
    search = v.steps[-1]
    assert search["step"].endswith(":amplifiers") and search["ranked"][0][0] == sub
    assert search["tries"] == [[1, 4, v.worst_cosine()]]
    (f,) = block_list_findings(res)
    assert f.code == "OM724" and sub in f.message and "amplifies" in f.message


@pytest.mark.slow  # the suite's 20-minute budget: the amplifier rule itself is checked by test_nodes_that_amplify_float16_error_stay_float32
def test_an_amplifier_search_that_misses_the_budget_is_rejected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search only proposes block lists; each is verified. A ranking that names the wrong
    node (the first Linear layer) leaves the candidate rejected and says what it tried; a
    measuring step that fails, or that finds no node adding error, leaves it rejected and says
    that."""
    model = Cancellation().eval()
    x = torch.randn(8, 64)
    src = _export(model, x, tmp_path / "m.onnx")
    monkeypatch.setattr(fp16_search, "AMPLIFIERS",
                        "tests.optimize.bad_passes:misleading_amplifiers")
    res = optimize(src, model, (x,), precision="fp16", pipelines=FP16, **FAST)
    v = res.variants[1]
    assert not v.verified and v.is_rejected(Why.OUTSIDE_BUDGET)
    assert "did not reach the budget either" in v.rejected
    assert "worst cosine by nodes kept float32: 1 -> 0.9" in v.rejected
    assert not v.blocked  # the failed variant as it was: no node kept float32
    assert v.steps[-1]["tries"][0][:2] == [1, 1]

    monkeypatch.setattr(fp16_search, "AMPLIFIERS", "tests.optimize.bad_passes:raising_pass")
    res = optimize(src, model, (x,), precision="fp16", pipelines=FP16, **FAST)
    v = res.variants[1]
    assert not v.verified and "measuring where float16 adds error failed" in v.rejected

    monkeypatch.setattr(fp16_search, "AMPLIFIERS", "tests.optimize.bad_passes:no_amplifiers")
    res = optimize(src, model, (x,), precision="fp16", pipelines=FP16, **FAST)
    v = res.variants[1]
    assert not v.verified and v.is_rejected(Why.OUTSIDE_BUDGET)
    assert "no node adds float16 error of 0.001 or more" in v.rejected and not v.blocked


def test_a_converter_that_casts_once_per_reader_still_loads() -> None:
    """onnxruntime-gpu 1.31.1's converter puts one Cast per blocked reader of a float16 value,
    all of one name: ONNX Runtime refused such a file (two blocked nodes reading a Constant)."""
    cast = helper.make_node("Cast", ["c"], ["c_cast_to_fp32"], to=TensorProto.FLOAT,
                            name="c_cast_to_fp32_node")
    nodes = [helper.make_node("Constant", [], ["c"], name="k",
                              value=helper.make_tensor("v", TensorProto.FLOAT16, [], [2.0])),
             cast, helper.make_node("Add", ["x", "c_cast_to_fp32"], ["a"], name="add"),
             cast, helper.make_node("Sub", ["a", "c_cast_to_fp32"], ["y"], name="sub")]
    vi = helper.make_tensor_value_info("c_cast_to_fp32", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2])],
                              [helper.make_tensor_value_info("y", 1, [2])], value_info=[vi, vi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model)
    assert fp16.drop_duplicate_nodes(model) == 1
    onnx.checker.check_model(model)
    assert [n.name for n in model.graph.node] == ["k", "c_cast_to_fp32_node", "add", "sub"]
    assert len(model.graph.value_info) == 1
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": np.ones(2, np.float32)})[0], [1.0, 1.0])


def test_relative_error_leaves_the_models_own_inf_and_nan_out() -> None:
    """A guarded division's inf in the float32 graph is the model's own: float16 computing the
    same inf there adds no error; a float16 inf or nan where float32 is finite (or a finite
    value where float32 is inf) is the largest error there is."""
    ref = np.array([1.0, np.inf, np.nan, 2.0], np.float32)
    close = np.array([1.001, np.inf, np.nan, 2.0], np.float16)
    assert 0 < fp16.relative_error(close, ref) < 1e-3
    for bad in ([1.0, 5.0, np.nan, 2.0], [1.0, np.inf, np.nan, np.inf],
                [np.nan, np.inf, np.nan, 2.0], [1.0, -np.inf, np.nan, 2.0]):
        assert fp16.relative_error(np.array(bad, np.float16), ref) == fp16.ERR_CAP
    assert fp16.relative_error(np.zeros(3, np.float16), np.zeros(3, np.float32)) == 0.0
    assert fp16.relative_error(np.zeros(3, np.float16), np.zeros(4, np.float32)) == fp16.ERR_CAP
