"""The ONNX Runtime fusion pass (optimize/passes/fusions.py): what it fuses, what it leaves out
for the CPU, and each mend of onnxscript and onnx-ir, shown by the file it breaks without it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

import onnxmedic
from onnxmedic.optimize import passes
from onnxmedic.optimize.passes import fusions
from tests.optimize.fixture_models import (
    BAG_ARGS,
    Bags,
    NormAttention,
    export_dynamo,
    op_types,
    run_bags,
)


def test_ort_fusions_fuse_rmsnorm_and_attention(tmp_path: Path) -> None:
    src = export_dynamo(NormAttention(), (torch.randn(1, 16, 32),), tmp_path / "m.onnx")
    info = fusions.ort_fusions(str(src), str(tmp_path / "f.onnx"))
    assert info["fusions"].get("rms_normalization") == 1
    assert info["fusions"].get("sdpa") == 1
    ops = op_types(tmp_path / "f.onnx")
    assert ops["SimplifiedLayerNormalization"] == 1 and ops["MultiHeadAttention"] == 1
    assert info["nodes_after"] < info["nodes_before"]


class ResidualBlock(torch.nn.Module):
    """attention + residual LayerNorm + bias-GELU MLP + residual LayerNorm (a BERT layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.ln1 = torch.nn.LayerNorm(32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.ln2 = torch.nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 8).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2)).transpose(1, 2).reshape(1, -1, 32)
        h = self.ln1(x + a)
        return self.ln2(h + self.down(F.gelu(self.up(h))))


def test_ort_fusions_without_norm_fusions_keeps_attention_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU variant: attention fused, residual norms and bias-GELU left to ONNX Runtime;
    both variants compute what the plain export does. A fusion onnxscript no longer has by
    that name fails the pass (a rejected variant), never silently fuses it."""
    import onnxruntime as ort

    x = torch.randn(1, 16, 32)
    src = export_dynamo(ResidualBlock(), (x,), tmp_path / "m.onnx")
    fusions.ort_fusions(str(src), str(tmp_path / "full.onnx"))
    info = fusions.ort_fusions(str(src), str(tmp_path / "att.onnx"), norm_fusions=False)
    full, att = op_types(tmp_path / "full.onnx"), op_types(tmp_path / "att.onnx")
    assert full["SkipLayerNormalization"] == 2 and full["BiasGelu"] == 1
    assert att["MultiHeadAttention"] == 1 and info["fusions"].get("sdpa") == 1
    assert att["SkipLayerNormalization"] == 0 and att["BiasGelu"] == 0
    assert att["LayerNormalization"] == 2
    outs = [ort.InferenceSession(str(tmp_path / f), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()})[0] for f in ("m.onnx", "full.onnx", "att.onnx")]
    assert np.allclose(outs[1], outs[0], atol=1e-5) and np.allclose(outs[2], outs[0], atol=1e-5)
    assert "ort-fusions-attention" in [p.name for p in passes.default_pipelines("cpu")]
    assert "ort-fusions-attention" not in [p.name for p in passes.default_pipelines("cuda")]
    monkeypatch.setattr(fusions, "SKIP_NORM_FUSIONS", ("fuse_skip_layer_norm_renamed",))
    with pytest.raises(AttributeError):
        fusions.ort_fusions(str(src), str(tmp_path / "x.onnx"), norm_fusions=False)


def test_ort_fusions_restore_the_reshape_gpt2s_attention_fusion_drops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxscript 0.7's MultiHeadAttention rewrite takes over GPT-2's Reshape to (B*S, D) (its
    Conv1D flattens before the Gemm), so the Gemm reads rank 3 and ONNX Runtime refuses the
    fused file; the pass puts the Reshape back: the file loads and computes the plain one's
    output, attention still fused. Without the mend it is refused."""
    import onnxruntime as ort
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    gpt2 = GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                n_positions=32, use_cache=False)).eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = gpt2

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=ids).last_hidden_state

    ids = torch.randint(0, 100, (1, 8))
    src = export_dynamo(Hidden().eval(), (ids,), tmp_path / "g.onnx")
    feed = {onnx.load(str(src)).graph.input[0].name: ids.numpy()}
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    info = fusions.ort_fusions(str(src), str(tmp_path / "f.onnx"))
    assert info["fusions"].get("mha2") == 1 and info["restored_reshapes"] == 1
    assert {n.op_type for n in onnx.load(str(tmp_path / "f.onnx")).graph.node} >= {
        "MultiHeadAttention"}
    got = ort.InferenceSession(str(tmp_path / "f.onnx"),
                               providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(fusions, "restore_flattened_attention", lambda model: 0)
    fusions.ort_fusions(str(src), str(tmp_path / "broken.onnx"))
    with pytest.raises(Exception, match="rank 2 but has rank 3"):
        ort.InferenceSession(str(tmp_path / "broken.onnx"), providers=["CPUExecutionProvider"])


class BatchFirstMatMul(torch.nn.Module):
    """nn.Transformer's pattern: an (S, B, D) input made batch-first, times a transposed 2-D
    weight."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x.transpose(0, 1), w.t())


def test_ort_fusions_unbatch_a_fused_matmul_the_kernel_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxscript 0.7 folds the Transpose(perm=[1, 0, 2]) into FusedMatMul's transBatchA
    against a 2-D weight; ONNX Runtime's kernel needs equal ranks >= 3 for it and fails at run
    time (every ort-fusions candidate of nn.Transformer was refused). The pass puts the
    Transpose back and clears the flag: the file computes PyTorch's output."""
    x, w = torch.randn(5, 3, 16), torch.randn(8, 16)
    src = export_dynamo(BatchFirstMatMul(), (x, w), tmp_path / "m.onnx")
    feed = {"x": x.numpy(), "w": w.numpy()}
    info = fusions.ort_fusions(str(src), str(tmp_path / "f.onnx"))
    assert info["new_ops"] == {"FusedMatMul": 1} and info["unbatched_fused_matmuls"] == 1
    fused = {n.op_type: n for n in onnx.load(str(tmp_path / "f.onnx")).graph.node}
    attrs = {a.name: a.i for a in fused["FusedMatMul"].attribute}
    assert attrs["transB"] == 1 and not attrs.get("transBatchA")
    assert list(fused["Transpose"].attribute[0].ints) == [1, 0, 2]
    sbx = onnxmedic.sandbox.run_model(tmp_path / "f.onnx", [feed])
    assert sbx.ok, sbx.summary()
    np.testing.assert_allclose(sbx.outputs[0][0], BatchFirstMatMul()(x, w).numpy(),
                               rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(fusions, "unbatch_fused_matmul", lambda model: 0)
    fusions.ort_fusions(str(src), str(tmp_path / "broken.onnx"))
    broken = onnxmedic.sandbox.run_model(tmp_path / "broken.onnx", [feed])
    assert broken.status == "run_error" and "transBatchA" in broken.error


def test_ort_fusions_keep_a_loop_carried_sequence_a_sequence(bags_onnx: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """onnx-ir 1.1's shape-inference merge (run inside onnxscript's ORT fusions) typed the
    Loop body's untyped carried sequence as a float tensor: ONNX Runtime refused every
    ort-fusions candidate of an EmbeddingBag ("Loop ... Type mismatch"). With the merge mended
    the file loads and computes PyTorch's output, the empty bag's zeros row included."""
    expected = Bags().eval()(*BAG_ARGS).detach().numpy()
    fusions.ort_fusions(str(bags_onnx), str(tmp_path / "f.onnx"))
    sbx = run_bags(tmp_path / "f.onnx")
    assert sbx.ok, sbx.summary()
    np.testing.assert_allclose(sbx.outputs[0][0], expected, rtol=1e-6, atol=1e-6)
    assert not sbx.outputs[0][0][1].any()
    monkeypatch.setattr(fusions, "keeping_sequence_types", contextlib.nullcontext)
    fusions.ort_fusions(str(bags_onnx), str(tmp_path / "broken.onnx"))
    broken = run_bags(tmp_path / "broken.onnx")
    assert broken.status == "load_error" and "Type mismatch" in broken.error
