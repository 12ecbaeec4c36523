"""export_pretrained on model objects, dtypes and the command line; and a real-size BERT-base
(slow)."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

import onnxmedic
from onnxmedic.cli import main
from tests.hf import checkpoints


def test_the_users_model_object_is_borrowed_not_taken():
    model = checkpoints.build("bert-cls").train()
    model.bert.encoder.layer[0].eval()  # a submodule's own mode, kept as it is
    modes = {n: m.training for n, m in model.named_modules()}
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    res = onnxmedic.export_pretrained(model, task="text-classification", dynamic=False)
    assert res.ok, [f.one_paragraph() for f in res.errors]
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert torch.equal(torch.get_rng_state(), rng)
    codes = [f.code for f in res.findings]
    assert "OM011" in codes  # exported in eval mode, said so
    note = next(f for f in res.findings if f.code == "OM809")
    assert "no tokenizer" in note.message and note.details["outputs"] == ["logits"]


def test_model_object_task_detected_from_its_class():
    res = onnxmedic.export_pretrained(checkpoints.build("bert-qa"), dynamic=False)
    assert res.ok
    note = next(f for f in res.findings if f.code == "OM809")
    assert note.details["task"] == "question-answering"
    assert [o.name for o in res.onnx_model.graph.output] == ["start_logits", "end_logits"]


def test_model_object_dtype_is_not_converted():
    with pytest.raises(ValueError, match="dtype"):
        onnxmedic.export_pretrained(checkpoints.build("bert-cls"), dtype="fp16")


@pytest.mark.parametrize("dtype,onnx_type", [("fp16", onnx.TensorProto.FLOAT16),
                                             ("bf16", onnx.TensorProto.BFLOAT16)])
def test_dtype_sets_the_load_dtype(hf_folder, tmp_path, dtype, onnx_type):
    out = tmp_path / "m.onnx"
    res = onnxmedic.export_pretrained(hf_folder("distilbert"), out, dtype=dtype, dynamic=False)
    assert res.ok, [f.one_paragraph() for f in res.errors]
    floats = {i.data_type for i in onnx.load(str(out)).graph.initializer
              if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                 onnx.TensorProto.BFLOAT16)}
    assert floats == {onnx_type}
    assert f"loaded in {dtype}" in next(f for f in res.findings if f.code == "OM809").message


def test_no_output_file_keeps_the_model_in_memory(hf_folder):
    res = onnxmedic.export_pretrained(f"hf:{hf_folder('vit')}", dynamic=False)
    assert res.ok and res.path is None
    assert [o.name for o in res.onnx_model.graph.output] == ["logits"]
    assert res.model == f"hf:{hf_folder('vit')}"


def test_dynamic_dims_as_given(hf_folder, tmp_path):
    out, report = tmp_path / "m.onnx", tmp_path / "r.json"
    res = onnxmedic.export_pretrained(
        hf_folder("distilbert"), out, report=report,
        dynamic={"input_ids": {0: "n"}, "attention_mask": {0: "n"}})
    assert res.ok
    data = json.loads(report.read_text())  # the report is the checkpoint's, written at the end
    assert data["ok"] and data["path"] == str(out) and data["model"].startswith("hf:")
    assert data["findings"][0]["code"] == "OM809"
    assert data["stages"]["inputs"] == "passed"
    assert {c["name"] for c in data["verification"]} == {"logits"}
    dims = [d.dim_param or d.dim_value for d in
            onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim]
    assert dims[0] == "n" and isinstance(dims[1], int)


def test_cli_exports_a_checkpoint_folder(hf_folder, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    rc = main(["export", f"hf:{hf_folder('bert-cls')}", "-o", str(out), "--json",
               "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(text[text.index("{"):])
    assert data["ok"] and data["path"] == str(out)
    assert [o.name for o in onnx.load(str(out)).graph.output] == ["logits"]


def test_cli_task_and_dtype(hf_folder, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    rc = main(["export", f"hf:{hf_folder('bert-base')}", "--task", "sentence-similarity",
               "--dtype", "fp32", "--dynamic", "input_ids:0=batch_size",
               "--dynamic", "attention_mask:0=batch_size",
               "--dynamic", "token_type_ids:0=batch_size", "-o", str(out)])
    assert rc == 0, capsys.readouterr()
    names = [o.name for o in onnx.load(str(out)).graph.output]
    assert names == ["token_embeddings", "sentence_embedding"]


@pytest.mark.slow
def test_bert_base_real_size(tmp_path):
    """BERT-base (110 M parameters, the library's default config) saved as a folder with a
    tokenizer trained here: feature-extraction exported, verified and written."""
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    folder = tmp_path / "bert-base"
    AutoModel.from_config(AutoConfig.for_model("bert")).save_pretrained(folder)
    checkpoints.tokenizer().save_pretrained(folder)
    out = tmp_path / "bert.onnx"
    res = onnxmedic.export_pretrained(folder, out)
    assert res.ok, [f.one_paragraph() for f in res.errors]
    model = onnx.load(str(out), load_external_data=False)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask",
                                                   "token_type_ids"]
    assert [o.name for o in model.graph.output] == ["last_hidden_state"]
    assert out.stat().st_size > 400e6


def test_with_past_tasks_go_to_the_generation_package(monkeypatch, hf_folder, tmp_path):
    """The contract with onnxmedic.hf.export_generation(model, out_dir, *,
    tokenizer, task, verify, steps, prompts, opset, report, timeout) gets the loaded model (in
    eval mode) and the folder's tokenizer."""

    import onnxmedic.hf as hf
    from onnxmedic.result import ExportResult

    calls = []

    def export_generation(model, out_dir, **kw):
        calls.append((model, out_dir, kw))
        return ExportResult(ok=True, path=str(out_dir))

    monkeypatch.setattr(hf.backends, "export_generation", export_generation)  # its road
    res = onnxmedic.export_pretrained(hf_folder("gpt2"), tmp_path / "pkg", timeout=30)
    assert res.ok and len(calls) == 1
    model, out_dir, kw = calls[0]
    assert type(model).__name__ == "GPT2LMHeadModel" and not model.training
    assert out_dir == tmp_path / "pkg"
    assert kw["task"] == "text-generation-with-past" and kw["timeout"] == 30
    assert kw["tokenizer"] is not None and kw["verify"] is True
