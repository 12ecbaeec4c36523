"""Encoder-decoder packages (onnxmedic.hf.seq2seq): text2text-generation-with-past and
automatic-speech-recognition-with-past - the folder's layout, greedy generation verified
against PyTorch, faults in the cross-attention and self-attention caches caught, bad input."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import onnxmedic  # noqa: E402
from onnxmedic.hf import gen_verify, seq2seq  # noqa: E402
from onnxmedic.hf.seq2seq_verify import verify_seq2seq  # noqa: E402
from onnxmedic.hf.tasks import detect_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.zoo.seq2seq import ENCODER_DECODERS, build, save_encoder_decoder  # noqa: E402

STEPS = 4


def codes(findings):
    return [f.code for f in findings]


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """A tiny BART checkpoint folder (trained tokenizer) exported through export_pretrained
    with the task detected: the verified package, and the model and tokenizer it came from."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    root = tmp_path_factory.mktemp("s2s")
    folder = save_encoder_decoder("bart", root / "ckpt")
    result = onnxmedic.export_pretrained(folder, root / "pkg")
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    return model, AutoTokenizer.from_pretrained(folder), result, root / "pkg", folder


def _dims(values):
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in values}


def test_package_layout_and_generation(bart):
    model, tok, result, pkg, _ = bart
    assert result.ok, [f.one_paragraph() for f in result.errors]
    assert result.path == str(pkg) and result.stages["generate"] == "passed"
    names = {p.name for p in pkg.iterdir()}
    assert {seq2seq.ENCODER, seq2seq.DECODER, "config.json", "generation_config.json",
            "tokenizer.json"} <= names
    assert "genai_config.json" not in names and "OM825" in codes(result.findings)
    assert not [p for p in pkg.parent.iterdir() if ".tmp-" in p.name]
    enc = onnx.load(str(pkg / seq2seq.ENCODER)).graph
    dec = onnx.load(str(pkg / seq2seq.DECODER)).graph
    ins, outs = _dims(enc.input), _dims(enc.output)
    assert ins == {"input_ids": ["batch_size", "encoder_sequence_length"],
                   "attention_mask": ["batch_size", "encoder_sequence_length"]}
    assert list(outs)[:3] == ["last_hidden_state", "present.0.encoder.key",
                              "present.0.encoder.value"] and len(outs) == 5
    assert outs["present.1.encoder.value"] == ["batch_size", 4, "encoder_sequence_length", 16]
    ins, outs = _dims(dec.input), _dims(dec.output)
    assert list(ins)[:6] == ["input_ids", "encoder_attention_mask",
                             "past_key_values.0.decoder.key", "past_key_values.0.decoder.value",
                             "past_key_values.0.encoder.key", "past_key_values.0.encoder.value"]
    assert ins["input_ids"] == ["batch_size", "decoder_sequence_length"]
    assert ins["past_key_values.1.decoder.key"] == ["batch_size", 4,
                                                    "past_decoder_sequence_length", 16]
    assert ins["past_key_values.1.encoder.key"] == ["batch_size", 4, "encoder_sequence_length",
                                                    16]
    assert list(outs) == ["logits"] + [f"present.{i}.decoder.{kv}" for i in (0, 1)
                                       for kv in ("key", "value")]
    assert outs["present.0.decoder.key"] == ["batch_size", 4, "total_decoder_sequence_length",
                                             16]
    # verified as used: two texts, 8 tokens each, every step's logits within the budget
    g = result.generation
    assert len(g.tokens_torch) == 2 and all(len(t) == 8 for t in g.tokens_torch)
    assert g.tokens_onnx == g.tokens_torch and len(set(g.tokens_torch[0])) > 1
    steps = [c for c in g.comparisons if "step" in c.input_set]
    assert len(steps) == 16 and all(c.ok and c.rule == "float64 budget" for c in steps)
    encoder = [c for c in g.comparisons if "encoder" in c.input_set]
    assert len(encoder) == 2 * 5 and all(c.ok for c in encoder)


def _corrupt(pkg: Path, dst: Path, graph: str, output: str, scale: float) -> Path:
    """A copy of the package whose ``graph`` output ``output`` is multiplied by ``scale``."""
    shutil.copytree(pkg, dst)
    proto = onnx.load(str(dst / graph))
    g = proto.graph
    inner = output + "_before_fault"
    for node in g.node:
        node.output[:] = [inner if n == output else n for n in node.output]
        node.input[:] = [inner if n == output else n for n in node.input]
    g.initializer.append(onnx.numpy_helper.from_array(np.array(scale, np.float32), "fault_k"))
    g.node.append(onnx.helper.make_node("Mul", [inner, "fault_k"], [output]))
    onnx.save(proto, str(dst / graph))
    return dst


def test_corrupted_cross_attention_weight_is_caught(bart, tmp_path):
    """Layer 1's cross-attention key projection scaled by 1.02 in the encoder graph: the
    decoder graph is right, but every step reads the wrong cache - named where it is (OM823),
    not as a decoder step, and localised in the encoder graph (OM610)."""
    model, tok, result, pkg, _ = bart
    bad = tmp_path / "bad"
    shutil.copytree(pkg, bad)
    proto = onnx.load(str(bad / seq2seq.ENCODER))
    # the cross-attention projections read the encoder's output: k0, v0, k1, v1
    weight = [n.input[1] for n in proto.graph.node
              if n.op_type == "MatMul" and n.input[0] == "last_hidden_state"][2]
    init = next(t for t in proto.graph.initializer if t.name == weight)
    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * 1.02, weight))
    onnx.save(proto, str(bad / seq2seq.ENCODER))
    check = verify_seq2seq(bad, model, tok, steps=STEPS, prompts=["Return the list"],
                           programs=result.programs, genai=False)
    errors = [f for f in check.findings if f.severity.value == "error"]
    assert not check.ok and errors[0].code == "OM823"
    loc = [f for f in errors if f.code == "OM610"]
    assert loc and "input 0 encoder" in loc[0].message
    assert check.divergence == {"prompt": 0, "graph": "encoder",
                                "output": "present.1.encoder.key"}
    assert not [c for c in check.comparisons if "step" in c.input_set]


@pytest.mark.slow  # the decoder-only suite covers a wrong self-attention cache by default
def test_corrupted_self_attention_cache_is_caught(bart, tmp_path):
    """The decoder's grown self-attention cache off by 2%: the first step (past 0) is right,
    the next reads the wrong cache - caught at step 1 and localised in the decoder graph."""
    model, tok, result, pkg, _ = bart
    bad = _corrupt(pkg, tmp_path / "bad", seq2seq.DECODER, "present.0.decoder.value", 1.02)
    check = verify_seq2seq(bad, model, tok, steps=STEPS, prompts=["Return the list"],
                           programs=result.programs, genai=False)
    assert not check.ok
    first = next(f for f in check.findings if f.code in ("OM811", "OM812"))
    assert check.divergence["prompt"] == 0 and check.divergence["step"] == 1
    assert "step 1" in first.message
    steps = [c for c in check.comparisons if "step" in c.input_set]
    assert steps[0].ok and not steps[1].ok


@pytest.mark.parametrize("arch,model_type,task", [
    ("T5ForConditionalGeneration", "t5", "text2text-generation-with-past"),
    ("BartForConditionalGeneration", "bart", "text2text-generation-with-past"),
    ("MarianMTModel", "marian", "text2text-generation-with-past"),
    ("MBartForConditionalGeneration", "mbart", "text2text-generation-with-past"),
    ("PegasusForConditionalGeneration", "pegasus", "text2text-generation-with-past"),
    ("WhisperForConditionalGeneration", "whisper", "automatic-speech-recognition-with-past"),
])
def test_task_detected_from_architectures(arch, model_type, task):
    assert detect_task({"architectures": [arch], "model_type": model_type}) == task


def test_a_task_the_model_cannot_serve_names_those_it_can(bart):
    *_, folder = bart
    r = onnxmedic.export_pretrained(folder, folder.parent / "asr",
                                    task="automatic-speech-recognition-with-past")
    assert not r.ok and codes(r.errors) == ["OM805"]
    assert "text2text-generation-with-past" in r.errors[0].message


def test_not_an_encoder_decoder(tmp_path):
    from bench.zoo.generation import build as build_decoder

    r = seq2seq.export_seq2seq(build_decoder("gpt2"), tmp_path / "pkg",
                               task="text2text-generation-with-past")
    assert not r.ok and codes(r.errors) == ["OM822"] and r.exit_code == 1
    assert not (tmp_path / "pkg").exists() and not list(tmp_path.iterdir())


def test_no_decoder_start_token(bart, tmp_path):
    model, tok, *_ = bart
    saved = model.config.decoder_start_token_id, model.generation_config.decoder_start_token_id
    model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = None
    try:
        r = seq2seq.export_seq2seq(model, tmp_path / "pkg", tokenizer=tok)
    finally:
        model.config.decoder_start_token_id, model.generation_config.decoder_start_token_id = \
            saved
    assert not r.ok and codes(r.errors) == ["OM824"]
    assert not list(tmp_path.iterdir())


def test_audio_features_the_encoder_cannot_take(tmp_path):
    """A feature extractor of 1 s chunks (100 frames) for a Whisper whose encoder takes 3000:
    OM826, before anything is exported; and a Whisper asked for text2text: OM822."""
    from transformers import WhisperFeatureExtractor

    whisper = build("whisper")
    short = WhisperFeatureExtractor(feature_size=16, chunk_length=1)
    r = seq2seq.export_seq2seq(whisper, tmp_path / "pkg", processor=short)
    assert not r.ok and codes(r.errors) == ["OM826"]
    assert "[16, 3000]" in r.errors[0].message and "[16, 100]" in r.errors[0].message
    r = seq2seq.export_seq2seq(whisper, tmp_path / "pkg", task="text2text-generation-with-past")
    assert not r.ok and codes(r.errors) == ["OM822"]
    assert "automatic-speech-recognition-with-past" in r.errors[0].message
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_failed_graph_export_writes_nothing(tmp_path, monkeypatch):
    """ONNX Runtime crashing on the encoder graph (an injected abort): OM821 names the
    encoder, the existing folder is left as it was."""
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "abort:run")
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    r = seq2seq.export_seq2seq(build("marian"), out, steps=2)
    assert not r.ok and {"OM821", "OM818"} <= set(codes(r.errors))
    assert "encoder graph" in next(f for f in r.errors if f.code == "OM821").message
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ENCODER_DECODERS if n != "bart"])
def test_encoder_decoder_sweep(name, tmp_path):
    folder = save_encoder_decoder(name, tmp_path / "ckpt")
    r = onnxmedic.export_pretrained(folder, tmp_path / "pkg")
    assert r.ok, [f.one_paragraph() for f in r.errors]
    g = r.generation
    assert g.tokens_onnx == g.tokens_torch and all(len(t) == 8 for t in g.tokens_torch)
    if name == "whisper":
        cfg = json.loads((tmp_path / "pkg" / "genai_config.json").read_text())
        assert cfg["model"]["type"] == "whisper"
        assert cfg["model"]["encoder"]["inputs"]["audio_features"] == "input_features"
        assert (tmp_path / "pkg" / "preprocessor_config.json").is_file()
        if gen_verify.genai_available():
            assert g.tokens_genai == g.tokens_torch
    else:
        assert "OM825" in codes(r.findings)
    assert torch.is_grad_enabled()


def test_the_encoder_graph_keeps_only_what_is_read(tmp_path):
    """The encoder graph drops the decoder's weights it holds unread (gqa.remove_dead, as
    build_graphs calls it): an initializer nothing reads goes, one read only inside an If's
    branch stays, as do the nodes that make the outputs."""
    from onnx import TensorProto, helper, numpy_helper

    from onnxmedic.hf.transforms.gqa import remove_dead

    def branch(name):
        return helper.make_graph([helper.make_node("Identity", ["w_branch"], [name])], name,
                                 [], [helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                                    [1])])

    g = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch("t"), else_branch=branch("e")),
         helper.make_node("Neg", ["y"], ["unread"])], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.ones(1, np.float32), n) for n in ("w_branch", "w_unread")])
    assert remove_dead(g) == 1
    assert [i.name for i in g.initializer] == ["w_branch"]
    assert [n.op_type for n in g.node] == ["If"]


def _tiny_prophetnet():
    from transformers import ProphetNetConfig, ProphetNetForConditionalGeneration

    torch.manual_seed(0)
    cfg = ProphetNetConfig(vocab_size=64, hidden_size=32, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, num_encoder_layers=1, num_decoder_layers=1,
                           num_encoder_attention_heads=2, num_decoder_attention_heads=2,
                           max_position_embeddings=32, ngram=2, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=0)
    return ProphetNetForConditionalGeneration(cfg).eval()


def _tiny_switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    cfg = SwitchTransformersConfig(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=2, num_experts=2,
                                   encoder_sparse_step=1, decoder_sparse_step=1,
                                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return SwitchTransformersForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("make", [_tiny_prophetnet, _tiny_switch])
def test_encoder_output_is_passed_back_as_a_model_output(make):
    """ProphetNet reads encoder_outputs.last_hidden_state, Switch Transformers (and NLLB-MoE)
    .router_logits: onnxmedic's encoder graph module passes the encoder's output back as
    transformers' MoEModelOutput (a plain tuple raised AttributeError, blamed on the model as
    OM100)."""
    model = make()
    ids = torch.randint(3, 64, (2, 5))
    with torch.no_grad():
        hidden, cross = seq2seq.EncoderWithCross(model, 0)(ids, torch.ones_like(ids))
    assert hidden.shape == (2, 5, 32)
    assert len(cross) == 2 * model.config.num_decoder_layers  # a key and a value per layer


def test_pytorch_raising_on_the_decoder_step_blames_onnxmedics_inputs():
    """OM100 of the decoder graph (PyTorch raised on the example step onnxmedic built:
    ProphetNet's decoder takes one token per step with its cache) is OM828, naming the step
    as onnxmedic's; another finding is kept as it is."""
    from onnxmedic.findings import error

    raised = error("OM100", "preflight", "forward() raised in PyTorch itself",
                   details={"exception": "AssertionError: At the moment `use_cache` is only "
                            "supported for `decoder_input_ids` of length 1",
                            "inputs": "args[0]: int64[2x3]"})
    said = seq2seq.our_step_inputs(raised, _tiny_prophetnet())
    assert said.code == "OM828" and "ProphetNetForConditionalGeneration" in said.message
    assert "onnxmedic's, not yours" in said.message and "length 1" in said.message
    other = error("OM601", "verify", "differs")
    assert seq2seq.our_step_inputs(other, None) is other


def test_the_encoders_width_is_read_from_a_nested_config():
    """EncoderDecoderModel's, T5Gemma's and T5Gemma 2's configs keep the width in their
    encoder's config (the top one has no hidden_size: AttributeError, OM009 before)."""
    from types import SimpleNamespace

    from transformers import BertConfig, EncoderDecoderConfig, T5Config

    from onnxmedic.hf.seq2seq_modules import hidden_size

    enc = BertConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=2)
    dec = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    nested = EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    assert hidden_size(SimpleNamespace(config=nested)) == 48  # the encoder's, not the decoder's
    assert hidden_size(SimpleNamespace(config=T5Config(d_model=40))) == 40
    deeper = SimpleNamespace(encoder=SimpleNamespace(text_config=SimpleNamespace(hidden_size=24)))
    assert hidden_size(SimpleNamespace(config=deeper)) == 24
    with pytest.raises(ValueError, match="names no width"):
        hidden_size(SimpleNamespace(config=SimpleNamespace()))


def test_graph_verification_rows_name_the_package_outputs(bart):
    """docs/generation.md: the verification names the outputs as the package does."""
    _, _, result, pkg, _ = bart
    names = {o.name for graph in (seq2seq.ENCODER, seq2seq.DECODER)
             for o in onnx.load(str(pkg / graph), load_external_data=False).graph.output}
    shown = {c.name for c in result.verification}
    assert shown <= names, sorted(shown - names)
