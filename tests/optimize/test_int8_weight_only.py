"""The weight-only block-wise int8 candidate (passes.quantize_weight_only: ONNX Runtime's
MatMulNBitsQuantizer, 8-bit weights in blocks of 32, int8 compute): where per-tensor dynamic
quantization fails the accuracy budget, weight-only holds it, and a corrupted quantized block
is still caught by verification."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.optimize import Pipeline, judge_reduced, optimize, passes, reference_sets
from tests.optimize.fixture_models import sink_model

FAST = {"repeats": 3, "rounds": 1}
WEIGHT_ONLY = next(p for p in passes.default_pipelines("cpu", "int8")
                   if p.name == "int8-weight-only")


def _ops(path: Path) -> Counter[str]:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _cosine(src: Path, pipe: Pipeline, feeds: list, expected: list, dst: Path) -> float:
    ok, _, err = passes.run_pipeline(pipe, src, dst)
    assert ok, err
    sbx = onnxmedic.sandbox.run_model(dst, feeds)
    assert sbx.ok, sbx.error
    _, acc, _ = judge_reduced(["y"], expected, sbx.outputs)
    return min(m["cosine"] for m in acc.values())


@pytest.mark.slow  # the suite's 20-minute budget: weight-only int8 is verified, and a fault caught, by test_corrupted_quantized_block_is_rejected
def test_weight_only_verifies_where_per_tensor_dynamic_fails(tmp_path: Path) -> None:
    model, x, src = sink_model(tmp_path)
    feeds, expected, _, _ = reference_sets(src, model, onnxmedic.inputs.Inputs((x,)))
    blind = Pipeline("blind", [(f"{passes.__name__}:quantize_int8", {})], precision="int8")
    per_channel = Pipeline("blind-pc", [(f"{passes.__name__}:quantize_int8",
                                         {"per_channel": True})], precision="int8")
    weight_only = Pipeline("wo", [(f"{passes.__name__}:quantize_weight_only", {})],
                           precision="int8")
    cos_blind = _cosine(src, blind, feeds, expected, tmp_path / "b.onnx")
    cos_pc = _cosine(src, per_channel, feeds, expected, tmp_path / "c.onnx")
    cos_wo = _cosine(src, weight_only, feeds, expected, tmp_path / "w.onnx")
    assert cos_blind < 0.9 and cos_pc < 0.9  # the other tokens are lost
    assert cos_wo >= 0.9995
    res = optimize(src, model, (x,), precision="int8", pipelines=[WEIGHT_ONLY], **FAST)
    v = res.variants[1]
    assert v.name == "int8-weight-only" and v.verified, v.rejected
    assert v.steps[-1]["excluded"] == [] and v.steps[-1]["new_ops"] == {"MatMulNBits": 2}
    assert v.worst_cosine() >= 0.999
    assert v.median_ms is not None


def test_layer_error_models_the_block_scheme() -> None:
    """The sensitivity score follows each candidate's scheme: on a massive-activation row,
    per-tensor activation scaling loses the other rows, per-row blocks do not."""
    from onnxmedic.optimize import int8

    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 64)).astype(np.float32)
    a[0] *= 1000.0
    w = (rng.standard_normal((64, 32)) * 0.1).astype(np.float32)
    rows = slice(1, None)  # the ordinary tokens
    exact = a[rows] @ w
    for scheme, lo, hi in [(None, 0.5, 2.0), ({"per_channel": True}, 0.5, 2.0),
                           ({"block_size": 32, "accuracy_level": 4}, 0.0, 0.02)]:
        qa, qw = int8.quantized_operands(a, w, scheme)
        err = np.linalg.norm(qa[rows] @ qw - exact) / np.linalg.norm(exact)
        assert lo <= err <= hi, (scheme, err)
    assert int8.layer_error(a, w, {"block_size": 32, "accuracy_level": 4}) < 0.01


def test_corrupted_quantized_block_is_rejected(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault injected after the quantizer (8 blocks per layer set to the largest code) is
    judged on the candidate's real outputs: rejected, the plain file kept. Six layers, so the
    sensitivity search (at most 4 kept in float32) cannot exclude every corrupted one; it
    predicts so on the switchable file and builds no other count."""
    from onnxmedic.optimize.maker import CandidateMaker

    built: list[str] = []
    real = CandidateMaker.build

    def spy(self: CandidateMaker, pipe: Pipeline, src: Path, suffix: str = "") -> Any:
        built.append(f"{pipe.name}{suffix}")
        return real(self, pipe, src, suffix=suffix)

    monkeypatch.setattr(CandidateMaker, "build", spy)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.LayerNorm(64)).eval()
    x = torch.randn(1, 16, 64)
    src = tmp_path / "m.onnx"
    torch.onnx.export(model, (x,), str(src), dynamo=True, verbose=False)
    faulty = Pipeline("int8-weight-only-faulty",
                      WEIGHT_ONLY.steps + [("tests.optimize.bad_passes:corrupt_nbits_blocks", {})],
                      precision="int8")
    res = optimize(src, model, (x,), precision="int8", pipelines=[WEIGHT_ONLY, faulty],
                   out=tmp_path / "o.onnx", **FAST)
    good, bad = res.variants[1:]
    assert good.verified and min(m["cosine"] for m in good.accuracy.values()) >= 0.999
    # reported: every layer int8 (6 corrupted), after tries up to the 4 most sensitive float32
    assert bad.steps[-1]["corrupted"] == 6
    assert not bad.verified and bad.rejected.startswith("outside the accuracy budget")
    assert "keeping up to the 4 most sensitive layer(s) in float32 did not" in bad.rejected
    assert re.search(r"predicted on \d verification set\(s\)", bad.rejected)
    assert [b for b in built if b.startswith(faulty.name)] == [f"{faulty.name}-keep0"]
    assert min(m["cosine"] for m in bad.accuracy.values()) < 0.999
    assert res.chosen != bad.name


def test_int8_candidates_and_fused_dynamic_pipeline(tmp_path: Path) -> None:
    """int8 means 8 bit: every default int8 candidate is; the fused one runs the attention that
    quantize_dynamic leaves float32 as one MultiHeadAttention."""
    from tests.optimize.test_optimize import NormAttention

    int8 = {p.name: p for p in passes.default_pipelines("cpu", "int8") if p.precision == "int8"}
    assert set(int8) == {"int8-dynamic", "int8-dynamic-per-channel", "int8-dynamic-fused",
                         "int8-weight-only"}
    assert all(o.get("bits", 8) == 8 for p in int8.values() for _, o in p.steps)
    src = tmp_path / "a.onnx"
    torch.onnx.export(NormAttention().eval(), (torch.randn(1, 16, 32),), str(src),
                      dynamo=True, verbose=False)
    ok, steps, err = passes.run_pipeline(int8["int8-dynamic-fused"], src, tmp_path / "q.onnx")
    assert ok, err
    ops = _ops(tmp_path / "q.onnx")
    assert ops["MultiHeadAttention"] == 1 and ops["MatMulInteger"] == 1
    assert steps[0]["fusions"].get("sdpa") == 1
