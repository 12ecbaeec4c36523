"""export_pretrained, one task at a time, on tiny checkpoint folders: the task detected (or
given), the inputs and outputs named as optimum names them, the dims named, and the written
file computing, output by output, what the PyTorch model computes on the tokenizer's text."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import onnxmedic
from onnxmedic.hf import detect_task, supported_tasks, tasks

# (checkpoint, task given or None, task expected, inputs, outputs)
CASES = [
    ("bert", None, "fill-mask", ["input_ids", "attention_mask", "token_type_ids"], ["logits"]),
    ("bert-base", None, "feature-extraction", ["input_ids", "attention_mask", "token_type_ids"],
     ["last_hidden_state"]),
    ("bert-base", "sentence-similarity", "sentence-similarity",
     ["input_ids", "attention_mask", "token_type_ids"],
     ["token_embeddings", "sentence_embedding"]),
    ("bert-cls", None, "text-classification", ["input_ids", "attention_mask", "token_type_ids"],
     ["logits"]),
    ("bert-tok", None, "token-classification",
     ["input_ids", "attention_mask", "token_type_ids"], ["logits"]),
    ("bert-qa", None, "question-answering", ["input_ids", "attention_mask", "token_type_ids"],
     ["start_logits", "end_logits"]),
    ("bert-mc", None, "multiple-choice", ["input_ids", "attention_mask", "token_type_ids"],
     ["logits"]),
    ("gpt2", "text-generation", "text-generation", ["input_ids", "attention_mask"], ["logits"]),
    ("vit", None, "image-classification", ["pixel_values"], ["logits"]),
    ("segformer", None, "image-segmentation", ["pixel_values"], ["logits"]),
    ("wav2vec2", None, "audio-classification", ["input_values"], ["logits"]),
    ("yolos", None, "object-detection", ["pixel_values"], ["logits", "pred_boxes"]),
    ("clip", None, "zero-shot-image-classification",
     ["input_ids", "attention_mask", "pixel_values"],
     ["logits_per_image", "logits_per_text", "text_embeds", "image_embeds"]),
]


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _reference(folder, task, feeds):
    """What the PyTorch model computes on ``feeds``, by output name (the checkpoint loaded
    here, independently of onnxmedic)."""
    import transformers

    auto = tasks.auto_class(task, json.loads((folder / "config.json").read_text()))
    model = getattr(transformers, auto).from_pretrained(folder).eval()
    with torch.no_grad():
        kw = {k: torch.from_numpy(v) for k, v in feeds.items()}
        out = model(**kw, **({"use_cache": False} if task == "text-generation" else {}))
    if task == "sentence-similarity":
        tokens = out["last_hidden_state"]
        m = kw["attention_mask"].unsqueeze(-1).float()
        mean = (tokens * m).sum(1) / m.sum(1)
        return {"token_embeddings": tokens,
                "sentence_embedding": torch.nn.functional.normalize(mean, dim=1)}
    return out


# the vision, audio and multimodal cases run with -m slow (the suite's 20-minute budget); the text
# cases keep every naming rule in the suite
_SLOW_TASKS = {"clip", "wav2vec2", "yolos", "segformer", "vit"}


@pytest.mark.parametrize("name,task,expected,inputs,outputs",
                         [pytest.param(*c, id=f"{c[0]}-{c[2]}",
                                       marks=[pytest.mark.slow] if c[0] in _SLOW_TASKS else [])
                          for c in CASES])
def test_task_exports_verified_with_optimum_names(hf_folder, tmp_path, name, task, expected,
                                                   inputs, outputs):
    folder = hf_folder(name)
    out = tmp_path / "model.onnx"
    # segformer's symbolic sizes take long to capture: static here (yolos covers height/width)
    res = onnxmedic.export_pretrained(folder, out, task=task, dynamic=name != "segformer")
    assert res.ok, [f.one_paragraph() for f in res.errors]
    assert res.path == str(out) and out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no temp left over
    note = next(f for f in res.findings if f.code == "OM809")
    assert note.details["task"] == expected
    assert note.details["outputs"] == outputs
    model = onnx.load(str(out))
    assert [i.name for i in model.graph.input] == inputs
    assert [o.name for o in model.graph.output] == outputs
    first = _dims(model.graph.input[0])
    assert first[0] in ("batch_size", "text_batch_size") or name == "segformer"
    if name == "segformer":
        assert first == [2, 3, 64, 64]
    elif inputs[0] in ("input_ids", "input_values"):
        assert first[-1] == "sequence_length"
    if expected == "multiple-choice":
        assert first == ["batch_size", "num_choices", "sequence_length"]
    # the file computes, output by output, what PyTorch computes (names not mixed up)
    ex = note.details["inputs"]
    feeds = {k: v for k, v in _feeds(res, folder, expected).items() if k in ex}
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = dict(zip(outputs, sess.run(outputs, feeds)))
    ref = _reference(folder, expected, feeds)
    for k in outputs:
        want = ref[k].numpy()
        assert got[k].shape == want.shape, k
        np.testing.assert_allclose(got[k], want, rtol=1e-3, atol=1e-4, err_msg=k)


def _feeds(res, folder, task):
    """The example inputs export_pretrained used, rebuilt the same way (seeded)."""
    import transformers

    from onnxmedic.hf import checkpoint

    ckpt = checkpoint.resolve(str(folder))
    auto = tasks.auto_class(task, ckpt.config)
    model = getattr(transformers, auto).from_pretrained(folder).eval()
    tok = checkpoint.load_tokenizer(ckpt, False)
    proc = checkpoint.load_processor(ckpt, "audio" if task == "audio-classification" else "")
    ex = tasks.example_inputs(task, model, tok, proc, checkpoint.preprocessor_config(ckpt))
    return {k: v.numpy() for k, v in ex.kwargs.items()}


def test_the_text_is_real_text_through_the_tokenizer(hf_folder):
    import transformers

    folder = hf_folder("bert-qa")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(folder)
    ex = tasks.example_inputs("question-answering", model, tok)
    ids = ex.kwargs["input_ids"]
    assert ids.shape[0] == 2 and ex.kwargs["attention_mask"].min() == 0  # padded batch
    text = tok.decode(ids[0], skip_special_tokens=True)
    assert "onnxmedic" in text and "check" in text
    assert (ex.kwargs["token_type_ids"][0] == 1).any()  # question, then context
    assert "tokenizer" in ex.source


def test_the_fill_mask_text_holds_the_mask_token(hf_folder):
    import transformers

    folder = hf_folder("bert")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForMaskedLM.from_pretrained(folder)
    ex = tasks.example_inputs("fill-mask", model, tok)
    assert (ex.kwargs["input_ids"] == tok.mask_token_id).sum() == 2


@pytest.mark.parametrize("arch,model_type,extra,task", [
    ("BertForMaskedLM", "bert", {}, "fill-mask"),
    ("BertModel", "bert", {}, "feature-extraction"),
    ("BertForSequenceClassification", "bert", {}, "text-classification"),
    ("RobertaForTokenClassification", "roberta", {}, "token-classification"),
    ("DistilBertForQuestionAnswering", "distilbert", {}, "question-answering"),
    ("BertForMultipleChoice", "bert", {}, "multiple-choice"),
    ("GPT2LMHeadModel", "gpt2", {}, "text-generation-with-past"),
    # a causal LM that can return a cache gets it whatever use_cache says (MPT's is off)
    ("GPT2LMHeadModel", "gpt2", {"use_cache": False}, "text-generation-with-past"),
    ("MptForCausalLM", "mpt", {"use_cache": False}, "text-generation-with-past"),
    ("OpenAIGPTLMHeadModel", "openai-gpt", {}, "text-generation"),  # its forward has no cache
    ("LlamaForCausalLM", "llama", {}, "text-generation-with-past"),
    ("ViTForImageClassification", "vit", {}, "image-classification"),
    ("ViTModel", "vit", {}, "feature-extraction"),
    ("SegformerForSemanticSegmentation", "segformer", {}, "image-segmentation"),
    ("DetrForSegmentation", "detr", {}, "image-segmentation"),
    ("DetrForObjectDetection", "detr", {}, "object-detection"),
    ("YolosForObjectDetection", "yolos", {}, "object-detection"),
    ("Wav2Vec2ForSequenceClassification", "wav2vec2", {}, "audio-classification"),
    ("CLIPModel", "clip", {}, "zero-shot-image-classification"),
    ("T5ForConditionalGeneration", "t5", {}, "text2text-generation-with-past"),
    ("WhisperForConditionalGeneration", "whisper", {}, "automatic-speech-recognition-with-past"),
])
def test_task_detected_from_architectures(arch, model_type, extra, task):
    assert detect_task({"architectures": [arch], "model_type": model_type, **extra}) == task


def test_no_architectures_detects_nothing():
    assert detect_task({"model_type": "bert"}) is None


def test_sentence_transformers_folder_detects_sentence_similarity(tmp_path):
    (tmp_path / "modules.json").write_text("[]")
    cfg = {"architectures": ["BertModel"], "model_type": "bert"}
    assert detect_task(cfg, tmp_path) == "sentence-similarity"


def test_supported_tasks_follow_the_model_type():
    bert = supported_tasks({"model_type": "bert"})
    assert {"fill-mask", "question-answering", "sentence-similarity"} <= set(bert)
    assert "image-classification" not in bert and "audio-classification" not in bert
    vit = supported_tasks({"model_type": "vit"})
    assert "image-classification" in vit and "sentence-similarity" not in vit
    clip = supported_tasks({"model_type": "clip"})
    assert clip == ["zero-shot-image-classification"]
    wav = supported_tasks({"model_type": "wav2vec2"})
    assert "audio-classification" in wav and "text-classification" not in wav


def test_pooling_as_sentence_transformers_declares_it(tmp_path):
    assert tasks.Pooling.of_folder(tmp_path) == tasks.Pooling("mean", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    pool = tasks.Pooling.of_folder(tmp_path)
    assert pool == tasks.Pooling("cls", False)
    tokens = torch.randn(2, 3, 4)
    assert torch.equal(pool(tokens, torch.ones(2, 3)), tokens[:, 0])
    mean = tasks.Pooling()(tokens, torch.tensor([[1, 1, 0], [1, 1, 1]]))
    want = torch.stack([tokens[0, :2].mean(0), tokens[1].mean(0)])
    torch.testing.assert_close(mean, torch.nn.functional.normalize(want, dim=1))
