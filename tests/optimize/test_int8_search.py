"""The int8 sensitivity search on the whole model (int8.float_gains): one file with every
layer switchable between its int8 and its float32 node ranks the layers by what keeping each
float32 buys the model's outputs, and predicts how many the budget needs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxmedic.optimize import files, int8, int8_search, optimize, passes
from onnxmedic.optimize.maker import CandidateMaker

FAST = {"repeats": 3, "rounds": 1}
WEIGHT_ONLY = next(p for p in passes.default_pipelines("cpu", "int8")
                   if p.name == "int8-weight-only")
SCHEME = {"block_size": 32, "accuracy_level": 4}


class Misleading(torch.nn.Module):
    """Two layers where each one's own quantization error misleads. Each reads the input plus
    one constant channel per block of 32 that its weights ignore; the int8 kernel's per-block
    activation scale then coarsens the channels each does use. ``a``'s constant is 1000: its
    own error is ~100 %, yet its output enters the result scaled by 1e-3. ``b``'s is 40: its
    own error is ~10 %, and its output is the result: ``b`` is the layer the budget needs
    float32. ``third`` adds a plain layer ``c``, scaled by 1e-3 too."""

    def __init__(self, third: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 64) if third else None
        with torch.no_grad():
            self.a.weight[:, ::32] = 0.0
            self.b.weight[:, ::32] = 0.0
        spike = torch.zeros(64)
        spike[::32] = 1.0
        self.register_buffer("spike", spike)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(x + 40.0 * self.spike) + 1e-3 * self.a(x + 1000.0 * self.spike)
        return y if self.c is None else y + 1e-3 * self.c(x)


def _misleading(tmp_path: Path, third: bool = False
                ) -> tuple[torch.nn.Module, torch.Tensor, Path, str, str]:
    """The model, its input, its export, and the names of layer ``b`` and layer ``a``."""
    torch.manual_seed(0)
    model = Misleading(third).eval()
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(1))
    src = tmp_path / "m.onnx"
    torch.onnx.export(model, (x,), str(src), dynamo=True, verbose=False)
    matmuls = [n.name for n in onnx.load(str(src)).graph.node if n.op_type == "MatMul"]
    return model, x, src, matmuls[0], matmuls[1]  # in forward's order: b, a


def _builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The int8 tries the search builds, by suffix ("-keep0", "-keep1" ...)."""
    built: list[str] = []
    real = CandidateMaker.build

    def spy(self: CandidateMaker, pipe: Any, src: Path, suffix: str = "") -> Any:
        if suffix.startswith("-keep"):
            built.append(suffix)
        return real(self, pipe, src, suffix=suffix)

    monkeypatch.setattr(CandidateMaker, "build", spy)
    return built


@pytest.mark.parametrize("quantize,options", [("quantize_weight_only", SCHEME),
                                              ("quantize_int8", {"per_channel": True})])
def test_the_switchable_file_is_the_float32_or_the_int8_file_layer_by_layer(
        tmp_path: Path, quantize: str, options: dict[str, Any]) -> None:
    """Every switch on: the float32 file's outputs; every switch off: the int8 file's (to
    float32 rounding); one layer on: neither. Both quantizers' outputs keep their layer names."""
    _, x, src, _, _ = _misleading(tmp_path)
    q = tmp_path / "q.onnx"
    getattr(passes, quantize)(str(src), str(q), **options)
    layers = int8.switchable(str(src), str(q), str(tmp_path / "s.onnx"))
    assert sorted(layers) == sorted(n.name for n in onnx.load(str(src)).graph.node
                                    if n.op_type == "MatMul")
    feed = {"x": x.numpy()}

    def run(path: Path, switch: list[bool] | None = None) -> np.ndarray:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        extra = {} if switch is None else {int8.SWITCH: np.array(switch)}
        return sess.run(None, {**feed, **extra})[0]

    want, quantized = run(src), run(q)
    assert not np.allclose(want, quantized, rtol=1e-4, atol=1e-6)  # the int8 file is off
    np.testing.assert_allclose(run(tmp_path / "s.onnx", [True] * 2), want, rtol=1e-5, atol=1e-7)
    # to rounding: ONNX Runtime fuses a bias Add into MatMulNBits, not behind a switch
    np.testing.assert_allclose(run(tmp_path / "s.onnx", [False] * 2), quantized, rtol=1e-4,
                               atol=1e-6)
    one = run(tmp_path / "s.onnx", [True, False])
    assert not np.array_equal(one, want) and not np.array_equal(one, quantized)


def test_the_search_keeps_the_layer_the_whole_model_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer's own error ranks ``a`` first (~100 % against ~10 %); on the whole model ``b``
    is the one that matters. The search keeps ``b`` alone float32 and builds only the count it
    predicted (the all-layers try, then one layer)."""
    model, x, src, b, a = _misleading(tmp_path)
    npz = files.save_feeds([{"x": x.numpy()}], tmp_path / "f.npz")
    own = int8.layer_errors(str(src), "", str(npz), scheme=SCHEME)["errors"]
    assert own[a] > 0.5 > 0.2 > own[b] > 0.02  # the local measure misleads
    built = _builds(monkeypatch)
    res = optimize(src, model, (x,), precision="int8", pipelines=[WEIGHT_ONLY], **FAST)
    v = res.variants[1]
    assert v.verified, v.rejected
    assert v.steps[-1]["excluded"] == [b]
    assert built == ["-keep0", "-keep1"]
    search = next(s for s in v.steps if s["step"] == int8_search.FLOAT_GAINS)
    assert search["predicted"] == 1 and search["search_sets"].endswith(" verification set(s)")
    assert search["ranking"][0][0] == b and search["ranking"][0][1] > search["ranking"][1][1]
    assert search["curve"][0][1] < 0.999 <= search["curve"][-1][1]


@pytest.mark.slow  # the suite's 20-minute budget: the search's ranking is checked by the other tests of this file
def test_without_the_switch_search_each_layers_own_error_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the switch search fails (here: a step that raises), the layers' own errors rank
    them, as before it: ``a`` first - and with one of two layers at most kept float32, the
    search ends there: rejected, where the switch search (above) found ``b``."""
    model, x, src, b, a = _misleading(tmp_path)
    monkeypatch.setattr(int8_search, "FLOAT_GAINS", "tests.optimize.bad_passes:raising_pass")
    built = _builds(monkeypatch)
    res = optimize(src, model, (x,), precision="int8", pipelines=[WEIGHT_ONLY], **FAST)
    v = res.variants[1]
    assert not v.verified
    assert "keeping up to the 1 most sensitive layer(s) in float32 did not" in v.rejected
    assert built == ["-keep0", "-keep1"]
    ranked = next(s for s in v.steps if s["step"] == int8_search.LAYER_ERRORS)
    assert [n for n, _ in ranked["ranking"]] == [a, b]


def test_a_prediction_the_verification_refutes_hands_over_to_the_layers_own_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong prediction (here: the two best layers swapped, one layer said to do) is built
    and fails verification; the layers' own errors then rank, from one layer (``a``, which
    fails too), then two (``a`` and ``b``): the variant still verifies, and its report keeps
    the refuted prediction."""
    model, x, src, b, a = _misleading(tmp_path, third=True)
    monkeypatch.setattr(int8_search, "FLOAT_GAINS", "tests.optimize.bad_passes:misleading_gains")
    built = _builds(monkeypatch)
    res = optimize(src, model, (x,), precision="int8", pipelines=[WEIGHT_ONLY], **FAST)
    v = res.variants[1]
    assert v.verified, v.rejected
    assert v.steps[-1]["excluded"] == [a, b]
    assert built == ["-keep0", "-keep1", "-keep1", "-keep2"]
    ranked = next(s for s in v.steps if s["step"] == int8_search.LAYER_ERRORS)
    refuted = ranked["switch_search"]
    assert refuted["predicted"] == 1 and refuted["verified_cosine"] < 0.999


class _Curve:
    """A stand-in for int8._Switched: the worst cosine rises with the layers kept float32."""

    def __init__(self, needed: int) -> None:
        self.needed, self.tried = needed, []

    def worst(self, keep: list[int], sets: Any = None) -> float:
        self.tried.append(len(keep))
        return 0.9995 if len(keep) >= self.needed else 0.99 + len(keep) * 1e-4


def test_the_predicted_count_is_the_fewest_found_by_doubling_then_halving() -> None:
    """11 layers needed, cap 21: 1, 2, 4, 8, 16 (passes), then 12, 10, 11 - the fewest."""
    run = _Curve(11)
    k, curve = int8.fewest_float32(run, list(range(84)), 0.999, 21, time.monotonic() + 60)
    assert k == 11 and run.tried == [1, 2, 4, 8, 16, 12, 10, 11]
    assert [c[0] for c in curve] == sorted(run.tried)
    run = _Curve(30)  # beyond the cap: tried up to the cap itself, none predicted
    assert int8.fewest_float32(run, list(range(84)), 0.999, 21, time.monotonic() + 60)[0] is None
    assert run.tried[-1] == 21
    run = _Curve(11)  # out of time: nothing tried, none predicted
    assert int8.fewest_float32(run, list(range(84)), 0.999, 21, time.monotonic() - 1) == (None, [])


def test_worst_cosine_scores_as_the_budget_does() -> None:
    w = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert int8.worst_cosine([w], [w]) == pytest.approx(1.0)
    assert int8.worst_cosine([w[:1]], [w]) == 0.0  # another shape
    assert int8.worst_cosine([np.array([1, 3])], [np.array([1, 2])]) == 0.0  # integers differ
    assert int8.worst_cosine([np.array([1, 2])], [np.array([1, 2])]) == 1.0
    bad = w.copy()
    bad[0, 0] = np.nan
    assert int8.worst_cosine([bad], [w]) == 0.0  # NaN where the reference has a number
    assert int8.worst_cosine([w, -w], [w, w]) == pytest.approx(-1.0)  # the worst output
    assert int8.exclusion_cap(84) == 21 and int8.exclusion_cap(6) == 4
    assert int8.exclusion_cap(2) == 1 and int8.exclusion_cap(84, 3) == 3



def test_the_switchable_file_brings_the_float32_weights_it_needs(tmp_path: Path) -> None:
    """A layer whose weight name the int8 file reuses for another tensor gets the float32
    weight under a name of its own; a layer whose float32 input the int8 file no longer
    computes (here: a Transpose the quantizer folded away) is not switchable."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))

    def save(nodes: list[Any], inits: dict[str, np.ndarray], path: Path) -> Path:
        graph = helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
            [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])],
            [numpy_helper.from_array(v, k) for k, v in inits.items()])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        return path

    src = save([helper.make_node("MatMul", ["x", "w1"], ["y"], name="first"),
                helper.make_node("Transpose", ["w2"], ["w2t"], name="t"),
                helper.make_node("MatMul", ["y", "w2t"], ["z"], name="second")],
               {"w1": w1, "w2": w2}, tmp_path / "f.onnx")
    # the "int8" file: first's weight rounded under the same name, second's transpose folded
    q = save([helper.make_node("MatMul", ["x", "w1"], ["y"], name="first_q"),
              helper.make_node("MatMul", ["y", "w2_folded"], ["z"], name="second_q")],
             {"w1": np.round(w1), "w2_folded": np.round(w2.T)}, tmp_path / "q.onnx")
    layers = int8.switchable(str(src), str(q), str(tmp_path / "s.onnx"))
    assert layers == ["first"]
    x = rng.standard_normal((2, 8)).astype(np.float32)
    sess = ort.InferenceSession(str(tmp_path / "s.onnx"), providers=["CPUExecutionProvider"])
    on = sess.run(None, {"x": x, int8.SWITCH: np.array([True])})[0]
    off = sess.run(None, {"x": x, int8.SWITCH: np.array([False])})[0]
    np.testing.assert_allclose(on, (x @ w1) @ np.round(w2.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(off, (x @ np.round(w1)) @ np.round(w2.T), rtol=1e-5, atol=1e-5)


def test_a_search_out_of_time_says_so(tmp_path: Path) -> None:
    """No time left: no layer scored, nothing predicted, and the rejection says the search
    ran out of time rather than that no count reached the budget."""
    _, x, src, _, _ = _misleading(tmp_path)
    q = tmp_path / "q.onnx"
    passes.quantize_weight_only(str(src), str(q), **SCHEME)
    npz = files.save_feeds([{"x": x.numpy()}], tmp_path / "f.npz")
    out = int8.float_gains(str(src), "", str(npz), str(q), 0.999, seconds=0.0)
    assert out["stopped"] and out["predicted"] is None and out["errors"] == {}
    why = int8_search.predicted_end(out, "1 verification set(s)")
    assert "the search ran out of time" in why and "did not reach" not in why
    done = int8.float_gains(str(src), "", str(npz), str(q), 0.999)
    assert not done["stopped"] and done["predicted"] == 1 and len(done["errors"]) == 2
