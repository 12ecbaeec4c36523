"""The streamed verification of a generation package (onnxmedic.hf.stream): its PyTorch side
and float64 reference, one decoder layer at a time from the safetensors, equal the whole
model's; a wrong weight in one layer of the package is refused."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from onnxmedic.hf import stream  # noqa: E402

STEPS = 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]


def _float64_model(model):
    """The whole model in float64, its rotary embedding too (transformers' computes it in
    float32 whatever the input; stream.rotary does not)."""
    md = copy.deepcopy(model).double()
    md.config._attn_implementation = "eager"
    rot = md.model.rotary_emb
    rot.forward = lambda x, position_ids: stream.rotary_embedding(rot, position_ids, torch.float64)
    return md


def test_streamed_logits_equal_the_whole_model(bf16):
    """float64: the whole model's within float64 rounding (one batch, right-padded: bit for
    bit on some CPUs, 1e-17 apart on an AMD EPYC, whose BLAS sums a padded batch in another
    order); float32: within float32 rounding of the whole model's own forward (another
    attention kernel)."""
    folder, model = bf16
    out = stream.streamed_logits(folder, PROMPTS)
    md = _float64_model(model)
    for i, seq in enumerate(PROMPTS):
        with torch.no_grad():
            want64 = md(input_ids=torch.tensor([seq]), use_cache=False).logits.numpy()
            want32 = model(input_ids=torch.tensor([seq]), use_cache=False).logits.numpy()
        got64, got32 = out[torch.float64][i], out[torch.float32][i]
        assert got64.shape == want64.shape == (1, len(seq), model.config.vocab_size)
        assert np.abs(got64 - want64).max() <= 16 * np.finfo(np.float64).eps * np.abs(
            want64).max()
        assert np.abs(got32 - want32).max() <= 16 * np.finfo(np.float32).eps * np.abs(
            want64).max()


def test_batches_in_one_pass_are_each_batch_alone(bf16):
    """streamed_batches (each layer's weights read and upcast once for every batch): each
    batch's logits are bit for bit those of its own streamed_logits pass."""
    folder, _model = bf16
    texts = [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [31, 32, 33, 34, 35, 36, 37, 38, 39]]
    both = stream.streamed_batches(folder, [PROMPTS, texts], (torch.float32,))[torch.float32]
    for batch, got in zip((PROMPTS, texts), both):
        alone = stream.streamed_logits(folder, batch, (torch.float32,))[torch.float32]
        assert len(got) == len(alone) == len(batch)
        for g, a in zip(got, alone):
            np.testing.assert_array_equal(g, a)


def test_the_head_read_in_slices_and_the_embeddings_rows_only(bf16, monkeypatch):
    """The output projection read VOCAB_SLICE rows at a time (100: four slices of the tiny
    vocabulary, the last one short) and the embedding's rows of the tokens only: the logits
    bit for bit those of one slice over the whole table; a row range is the tensor's rows."""
    folder, _model = bf16
    whole = stream.streamed_logits(folder, PROMPTS)
    monkeypatch.setattr(stream, "VOCAB_SLICE", 100)
    sliced = stream.streamed_logits(folder, PROMPTS)
    for d in (torch.float32, torch.float64):
        for a, b in zip(whole[d], sliced[d]):
            np.testing.assert_array_equal(a, b)
    w = stream.Weights(folder)
    table = w.get("model.embed_tokens.weight")
    assert torch.equal(w.get("model.embed_tokens.weight", (350, 400)), table[350:])
    ids = torch.tensor([[5, 3, 5], [383, 0, 3]])
    assert torch.equal(w.take("model.embed_tokens.weight", ids), table[ids])


def test_a_family_not_streamed_is_said(bf16):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2")
    assert "gpt2" in stream.streamable(cfg)
    with pytest.raises(ValueError, match="cannot be streamed"):
        stream.streamed_logits(_gpt2_folder(bf16[0].parent), [[1, 2]])


def test_the_command_refuses_a_folder_it_cannot_stream(bf16, tmp_path, capsys):
    """``python -m onnxmedic.hf.stream``: exit 1 and the reason, no traceback."""
    folder = _gpt2_folder(tmp_path)
    assert stream.main([str(tmp_path / "pkg"), str(folder)]) == 1
    assert "cannot be streamed" in capsys.readouterr().err
    assert stream.main([str(tmp_path / "pkg"), str(tmp_path / "missing")]) == 1
    assert "OM800" in capsys.readouterr().err  # not a checkpoint: said before loading


def _gpt2_folder(root: Path) -> Path:
    """A checkpoint (config and weights) of a family hf/stream.py has no layout for."""
    from transformers import AutoConfig, GPT2LMHeadModel

    folder = root / "gpt2"
    GPT2LMHeadModel(AutoConfig.for_model("gpt2", n_layer=1, n_embd=8, n_head=2,
                                         vocab_size=64)).save_pretrained(folder)
    return folder


def _wrong_weight(pkg: Path, dst: Path, shape: tuple[int, ...], scale: float) -> Path:
    """A copy of the package whose last initializer of ``shape`` (one layer's MLP weight:
    the last layer's) is multiplied by ``scale``."""
    shutil.copytree(pkg, dst)
    proto = onnx.load(str(dst / "model.onnx"))
    hits = [t for t in proto.graph.initializer if tuple(t.dims) == shape]
    assert hits, shape
    w = onnx.numpy_helper.to_array(hits[-1]) * np.float32(scale)
    hits[-1].CopyFrom(onnx.numpy_helper.from_array(w, hits[-1].name))
    onnx.save(proto, str(dst / "model.onnx"))
    return dst


@pytest.mark.slow
def test_streamed_verification_passes_the_package(bf16, package):
    folder, model = bf16
    check = stream.verify_package(package, folder, PROMPTS, steps=STEPS)
    assert check.ok, [f.message for f in check.findings]
    assert check.tokens_onnx == check.tokens_torch
    assert all(c.rule == "float64 budget" for c in check.comparisons)
    if check.tokens_genai is not None:
        assert check.tokens_genai == check.tokens_torch


@pytest.mark.slow
def test_a_wrong_weight_in_one_layer_is_refused(bf16, package, tmp_path):
    """One MLP weight of the last layer off by 1%: the streamed verification refuses the
    package at the prefill (OM811 or OM812), the logits outside the float64 budget."""
    folder, model = bf16
    cfg = model.config
    bad = _wrong_weight(package, tmp_path / "bad", (cfg.hidden_size, cfg.intermediate_size),
                        1.01)
    check = stream.verify_package(bad, folder, PROMPTS, steps=STEPS, genai=False)
    assert not check.ok
    assert {f.code for f in check.findings} & {"OM811", "OM812"}
    assert check.divergence["prompt"] == 0 and check.divergence["step"] == 0
    assert not check.comparisons[0].ok


def test_a_bfloat16_pass_is_transformers_own_bfloat16_forward(bf16):
    """The int4 budget's reference on a CPU with a bfloat16 multiply (stream_int4's
    reference_dtype): the layers run as transformers runs the checkpoint in bfloat16 (its
    rotary embedding made in float32, then rounded), the output projection in float32 over
    the same final hidden state; and it is not the float32 pass (it is another computation)."""
    folder, model = bf16
    out = stream.streamed_logits(folder, PROMPTS, (torch.bfloat16, torch.float32))
    mb = copy.deepcopy(model).to(torch.bfloat16)
    mb.config._attn_implementation = "eager"
    for i, seq in enumerate(PROMPTS):
        with torch.no_grad():
            h = mb(input_ids=torch.tensor([seq]), use_cache=False,
                   output_hidden_states=True).hidden_states[-1]
            want = (h.float() @ mb.lm_head.weight.float().T).numpy()
        got, got32 = out[torch.bfloat16][i], out[torch.float32][i]
        assert got.dtype == np.float32 and got.shape == want.shape
        gap = np.abs(got - want).max()
        assert gap <= 1e-6 * np.abs(want).max(), gap
        assert np.abs(got32 - want).max() > 100 * max(gap, 1e-9)
    # its rotary embedding is transformers' at positions bfloat16 cannot hold (past 256)
    pos = torch.arange(1000)[None]
    x = torch.zeros(1, 1000, model.config.hidden_size, dtype=torch.bfloat16)
    for got_t, want_t in zip(stream.rotary_embedding(model.model.rotary_emb, pos, torch.bfloat16),
                             model.model.rotary_emb(x, pos)):
        assert got_t.dtype == torch.bfloat16
        torch.testing.assert_close(got_t, want_t, rtol=0, atol=0)
