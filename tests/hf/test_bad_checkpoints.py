"""Bad input to export_pretrained and `onnxmedic export hf:...`: each gets its finding code
(OM800-OM808) and exit code, nothing is written, and nothing of an unsafe checkpoint runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import onnxmedic
from onnxmedic.cli import main


def _codes(res):
    return [f.code for f in res.errors]


def _fails_with(res, code, out_dir, exit_code=1):
    assert not res.ok and _codes(res) == [code], [f.one_paragraph() for f in res.findings]
    assert res.exit_code == exit_code
    assert res.stages == {"inputs": "failed"}
    assert list(out_dir.iterdir()) == []  # nothing written, no temp left over


@pytest.fixture
def out(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_folder_without_config_is_not_a_checkpoint(tmp_path, out):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "weights.txt").write_text("x")
    res = onnxmedic.export_pretrained(tmp_path / "ckpt", out / "m.onnx")
    _fails_with(res, "OM800", out)
    assert "no config.json" in res.errors[0].message and "weights.txt" in res.errors[0].message


def test_config_without_weights_is_not_a_checkpoint(tmp_path, out, hf_folder):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(hf_folder("bert") / "config.json", folder)
    res = onnxmedic.export_pretrained(str(folder), out / "m.onnx")
    _fails_with(res, "OM800", out)
    assert "no weights" in res.errors[0].message


@pytest.mark.parametrize("spec", ["./no/such/folder", "/no/such/folder", "a/b/c"])
def test_missing_folder_is_not_a_checkpoint(spec, out):
    _fails_with(onnxmedic.export_pretrained(spec, out / "m.onnx"), "OM800", out)


def test_a_file_or_a_broken_config_is_not_a_checkpoint(tmp_path, out):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    _fails_with(onnxmedic.export_pretrained(tmp_path / "model.safetensors", out / "m.onnx"),
                "OM800", out)
    (tmp_path / "config.json").write_text("{not json")
    _fails_with(onnxmedic.export_pretrained(tmp_path, out / "m.onnx"), "OM800", out)


def test_hub_id_without_network_is_om801(monkeypatch, tmp_path, out):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    res = onnxmedic.export_pretrained("onnxmedic-test/no-such-model", out / "m.onnx")
    _fails_with(res, "OM801", out)
    assert "HF_HUB_OFFLINE" in res.errors[0].message


REMOTE_CODE = '''
import pathlib
pathlib.Path(MARKER).write_text("the checkpoint's code ran")
import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

class TinyConfig(PretrainedConfig):
    model_type = "onnxmedic_tiny"
    def __init__(self, vocab_size=128, hidden_size=8, **kw):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        super().__init__(**kw)

class TinyModel(PreTrainedModel):
    config_class = TinyConfig
    def __init__(self, config):
        super().__init__(config)
        self.emb = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.post_init()
    def forward(self, input_ids, attention_mask=None, return_dict=True, **kw):
        if getattr(self.config, "fail_forward", False):
            raise RuntimeError("this model fails in PyTorch")
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return BaseModelOutput(last_hidden_state=torch.tanh(h))
'''


@pytest.fixture
def remote_folder(tmp_path, hf_folder):
    """A checkpoint whose architecture only its own code defines (config.json auto_map); its
    code leaves a file RAN beside it when it runs."""
    from safetensors.torch import save_file

    folder = tmp_path / "remote"
    folder.mkdir()
    # transformers runs a copy of the code (in its modules cache): the marker's path is absolute
    (folder / "tiny.py").write_text(f"MARKER = {str(folder / 'RAN')!r}\n" + REMOTE_CODE)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "onnxmedic_tiny", "architectures": ["TinyModel"], "vocab_size": 128,
        "hidden_size": 8, "auto_map": {"AutoConfig": "tiny.TinyConfig",
                                       "AutoModel": "tiny.TinyModel"}}))
    g = torch.Generator().manual_seed(0)
    save_file({"emb.weight": torch.randn(128, 8, generator=g)}, folder / "model.safetensors",
              metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_folder("bert") / name, folder)
    (folder / "RAN").unlink(missing_ok=True)
    return folder


def test_remote_code_is_refused_and_not_run(remote_folder, out):
    res = onnxmedic.export_pretrained(remote_folder, out / "m.onnx")
    _fails_with(res, "OM802", out)
    assert "tiny.TinyModel" in res.errors[0].message
    assert not (remote_folder / "RAN").exists()


def test_remote_code_runs_when_trusted(remote_folder, out):
    res = onnxmedic.export_pretrained(remote_folder, out / "m.onnx", task="feature-extraction",
                                      trust_remote_code=True)
    assert res.ok, [f.one_paragraph() for f in res.findings]
    assert (remote_folder / "RAN").exists()
    assert [p.name for p in out.iterdir()] == ["m.onnx"]


def test_a_model_that_fails_to_export_writes_nothing(remote_folder, out):
    cfg = json.loads((remote_folder / "config.json").read_text())
    (remote_folder / "config.json").write_text(json.dumps(dict(cfg, fail_forward=True)))
    dest = out / "m.onnx"
    res = onnxmedic.export_pretrained(remote_folder, dest, task="feature-extraction",
                                      trust_remote_code=True)
    assert not res.ok and "OM100" in _codes(res)
    assert list(out.iterdir()) == []  # no file, no temporary folder
    not_written = next(f for f in res.findings if f.code == "OM010")
    assert str(dest) in not_written.message
    assert res.stages["inputs"] == "passed" and res.stages["preflight"] == "failed"


class Payload:
    """Unpickled with weights_only=False, this creates the file it names."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_carrying_code_is_refused(tmp_path, out, hf_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_folder("bert-cls"), folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "UNPICKLED"
    torch.save({"bert.embeddings.word_embeddings.weight": torch.zeros(128, 32),
                "extra": Payload(marker)}, folder / "pytorch_model.bin")
    res = onnxmedic.export_pretrained(folder, out / "m.onnx")
    _fails_with(res, "OM803", out)
    assert not marker.exists()


def test_plain_bin_weights_load(tmp_path, out):
    from tests.hf import checkpoints

    folder = checkpoints.save(tmp_path / "bin", "distilbert", bin_weights=True)
    assert not (folder / "model.safetensors").exists()
    res = onnxmedic.export_pretrained(folder, out / "m.onnx", dynamic=False)
    assert res.ok, [f.one_paragraph() for f in res.findings]


def test_unknown_task_is_a_usage_error(hf_folder, out):
    res = onnxmedic.export_pretrained(hf_folder("bert"), out / "m.onnx", task="summarize")
    _fails_with(res, "OM804", out, exit_code=2)
    assert "fill-mask" in res.errors[0].suggestion


def test_task_the_model_cannot_serve_names_those_it_can(hf_folder, out):
    res = onnxmedic.export_pretrained(hf_folder("bert"), out / "m.onnx",
                                      task="image-classification")
    _fails_with(res, "OM805", out)
    msg = res.errors[0].message
    assert "fill-mask" in msg and "question-answering" in msg and "image-" not in msg.split(
        "serves:")[1]


def test_no_architectures_and_no_task_is_om805(tmp_path, out, hf_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_folder("bert"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architectures"]
    (folder / "config.json").write_text(json.dumps(cfg))
    res = onnxmedic.export_pretrained(folder, out / "m.onnx")
    _fails_with(res, "OM805", out)
    assert "--task" in res.errors[0].suggestion


def test_model_object_without_the_task_head_is_om805():
    from tests.hf import checkpoints

    model = checkpoints.build("bert-base")
    res = onnxmedic.export_pretrained(model, task="fill-mask")
    assert _codes(res) == ["OM805"] and "BertModel" in res.errors[0].message
    assert "feature-extraction" in res.errors[0].message


def test_a_causal_lm_whose_config_has_no_use_cache_loads(hf_folder, out):
    """OpenAI GPT keeps no cache and its config has no use_cache: its default task is
    text-generation, and loading it does not hand use_cache=False to the model's __init__
    (TypeError, refused as OM808: the folder was blamed)."""
    res = onnxmedic.export_pretrained(hf_folder("openai-gpt"), out / "m.onnx")
    assert res.ok and res.exit_code == 0, _codes(res)
    said = next(f.message for f in res.findings if f.code == "OM809")
    assert "task text-generation " in said, said


def test_with_past_on_an_encoder_says_it_keeps_no_cache(hf_folder, out):
    """BERT has a causal-LM class (BertLMHeadModel), so the task passes the checkpoint's
    checks; loaded without is_decoder it returns no cache: OM817, not an internal error."""
    res = onnxmedic.export_pretrained(hf_folder("bert"), out / "pkg",
                                      task="text-generation-with-past")
    assert not res.ok and _codes(res) == ["OM817"] and res.exit_code == 1
    assert "returns no KV cache" in res.errors[0].message
    assert "is_decoder=False" in res.errors[0].message
    # the task that serves it (BigBird's tiny checkpoint verifies with it, family sweep)
    assert "--task text-generation " in res.errors[0].suggestion
    assert list(out.iterdir()) == []


@pytest.mark.slow  # a fresh interpreter (transformers' own stderr handler), ~15 s
def test_with_past_on_an_encoder_is_said_once_in_our_words(hf_folder, tmp_path):
    """The refusal (OM817: set is_decoder=True) without transformers' "add `is_decoder=True`"
    line on stderr, which says the same."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "onnxmedic", "export", f"hf:{hf_folder('bert')}",
                        "--task", "text-generation-with-past", "-o", str(tmp_path / "pkg"),
                        "--no-progress"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 1 and "OM817" in p.stdout + p.stderr, p.stderr[-2000:]
    assert "is_decoder=True." not in p.stderr and "[transformers]" not in p.stderr, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name,kinds", [("lfm2", {"conv", "key", "value"}),
                                        ("falcon_h1", {"key", "value", "conv", "recurrent"}),
                                        ("mamba", {"conv", "recurrent"})])
def test_with_past_on_a_state_cache_verifies(name, kinds, hf_folder, out):
    """LFM2's convolution state, Falcon-H1's Mamba-2 states beside its keys and values and
    Mamba's states alone are carried by the package (past.{i}.conv / .recurrent, one token
    per step), verified token by token in onnxmedic's own loop (OM829: no genai_config.json);
    they were OM827 refusals (LFM2 before that OM009, Falcon-H1 OM100)."""
    from onnxmedic import genpackage

    res = onnxmedic.export_pretrained(hf_folder(name), out / "pkg", backend="export",
                                      task="text-generation-with-past")
    codes = [f.code for f in res.findings]
    assert res.ok and res.exit_code == 0 and "OM829" in codes, codes
    assert res.generation.tokens_onnx == res.generation.tokens_torch
    layout = genpackage.read_package(out / "pkg")
    assert layout.step_tokens == 1 and {c.kind for c in layout.cache} == kinds
    assert not (out / "pkg" / "genai_config.json").exists()


@pytest.mark.slow
def test_a_state_not_fed_back_is_caught_and_localised(hf_folder, out, monkeypatch):
    """The own loop feeding Mamba's states back as zeros (a loop that drops the state): the
    prefill's logits diverge from PyTorch's from the prompt's second token on, and the
    verification fails, nothing written (the acceptance rule for a state carried from one
    token to the next)."""
    import numpy as np

    from onnxmedic import genpackage

    real = genpackage.StepLayout.presents

    def forgetful(self, outputs):
        return [np.zeros_like(t) if c.state else t
                for c, t in zip(self.self_cache, real(self, outputs))]

    monkeypatch.setattr(genpackage.StepLayout, "presents", forgetful)
    res = onnxmedic.export_pretrained(hf_folder("mamba"), out / "pkg", backend="export",
                                      task="text-generation-with-past")
    codes = _codes(res)
    assert not res.ok and res.exit_code == 1 and "OM009" not in codes, codes
    assert {"OM811", "OM812"} & set(codes) and "OM818" in codes, codes
    assert list(out.iterdir()) == []


def test_state_layers_the_package_cannot_carry_are_om827(tmp_path):
    """A cache layer with two states (the package carries one convolution and one
    state-space state per layer) is refused before any export, the layer named."""
    from types import SimpleNamespace

    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionLayer

    from onnxmedic.hf import generation

    layer = LinearAttentionLayer(number_of_states=2)
    layer.conv_states[0] = layer.conv_states[1] = torch.zeros(1, 8, 3)
    cache = DynamicCache()
    cache.layers = [layer]

    class TwoStates(torch.nn.Module):
        config = SimpleNamespace(vocab_size=10)

        def forward(self, **kw):
            return SimpleNamespace(past_key_values=cache)

    said = generation.cache_problem(TwoStates())
    assert said is not None and said.code == "OM827"
    assert "0 LinearAttentionLayer: conv_states [1, 8, 3]" in said.message
    assert "2 states per layer" in said.message
    assert "--task text-generation" in said.suggestion
    assert generation.unsupported_states(DynamicCache()) == []


def test_a_layer_that_needs_no_cache_is_carried_as_nothing():
    """transformers' DummyLayer (an MLP or MoE layer of a hybrid such as Nemotron-H: no cache
    at all) is no reason to refuse (was OM827 "no keys and no state"); a layer of another
    class holding nothing still is."""
    from transformers import DynamicCache
    from transformers.cache_utils import DummyLayer, LinearAttentionLayer

    from onnxmedic.hf import generation

    state = LinearAttentionLayer()
    state.conv_states[0] = torch.zeros(1, 8, 3)
    cache = DynamicCache()
    cache.layers = [state, DummyLayer()]
    assert generation.unsupported_states(cache) == []
    assert generation.cache_spec(cache) == [(0, "conv")]
    cache.layers = [state, LinearAttentionLayer()]
    assert generation.unsupported_states(cache) == [
        "1 LinearAttentionLayer: no keys and no state"]
    kv = DynamicCache([(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))])
    kv.layers.append(DummyLayer())  # Gemma 3n: a layer reading an earlier layer's keys (OM009)
    said = generation.unsupported_states(kv)
    assert len(said) == 1 and said[0].startswith("1 DummyLayer") and "KV sharing" in said[0]


def test_a_model_whose_own_cache_raises_is_om830(hf_folder, out):
    """A tiny Jamba whose layer pattern leaves no attention layer: its own forward with a
    cache raises in transformers (get_seq_length on state layers only), as generate() does;
    a finding naming PyTorch's error (was OM009, an internal error, in the example step)."""
    import transformers

    folder = hf_folder("jamba-noattn")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with pytest.raises(ValueError, match="get_seq_length"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    res = onnxmedic.export_pretrained(folder, out / "pkg", task="text-generation-with-past",
                                      backend="export")
    assert not res.ok and res.exit_code == 1 and _codes(res) == ["OM830"], _codes(res)
    assert "get_seq_length" in res.errors[0].message
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("backend", ["auto", "export"])
def test_a_model_whose_own_generate_raises_is_om830_on_every_backend(hf_folder, out, backend):
    """A tiny GraniteMoeHybrid whose layers are all Mamba (its default pattern), which
    onnxruntime-genai's builder says it serves: generate() raises in transformers (its cache
    of state layers cannot say its length). Refused with OM830 naming PyTorch's error before
    the builder is tried (was OM009 on --backend auto: PyTorch's side of the builder's check
    raised)."""
    import transformers

    folder = hf_folder("granitemoehybrid-noattn")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with pytest.raises(ValueError, match="get_seq_length"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    res = onnxmedic.export_pretrained(folder, out / "pkg", task="text-generation-with-past",
                                      backend=backend)
    assert not res.ok and res.exit_code == 1 and _codes(res) == ["OM830"], _codes(res)
    assert "get_seq_length" in res.errors[0].message
    assert not (out / "pkg").exists()


def test_pytorch_failing_on_onnxmedics_step_inputs_is_om828(hf_folder, out):
    """MiniCPM3 with fewer KV heads than query heads generates in PyTorch, but its attention
    raises on the graph's example step (3 new tokens after a past of 4), a step generate()
    never takes: the finding blames onnxmedic's inputs (was OM100: 'Fix the model')."""
    import transformers

    folder = hf_folder("minicpm3")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5, 6, 7]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)
    res = onnxmedic.export_pretrained(folder, out / "pkg", task="text-generation-with-past")
    assert not res.ok and res.exit_code == 1 and "OM828" in _codes(res), _codes(res)
    assert "OM100" not in _codes(res) and "OM009" not in _codes(res)
    said = next(f for f in res.errors if f.code == "OM828")
    assert "3 new tokens after a past of 4" in said.message
    assert "onnxmedic's, not yours" in said.message and "size of tensor" in said.message
    assert list(out.iterdir()) == []


def test_with_past_without_a_tokenizer(tmp_path, out):
    from tests.hf import checkpoints

    folder = checkpoints.save(tmp_path / "notok", "gpt2", tok=None)
    res = onnxmedic.export_pretrained(folder, out / "pkg", task="text-generation-with-past")
    _fails_with(res, "OM806", out)


def test_missing_tokenizer_for_a_text_task(tmp_path, out):
    from tests.hf import checkpoints

    folder = checkpoints.save(tmp_path / "notok", "bert-cls", tok=None)
    res = onnxmedic.export_pretrained(folder, out / "m.onnx")
    _fails_with(res, "OM806", out)
    assert "tokenizer.save_pretrained" in res.errors[0].suggestion


def test_seq2seq_without_past_is_not_available(tmp_path, out):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from tests.hf import checkpoints

    cfg = AutoConfig.for_model("t5", d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                               vocab_size=128, decoder_start_token_id=0)
    folder = tmp_path / "t5"
    AutoModelForSeq2SeqLM.from_config(cfg).save_pretrained(folder)
    checkpoints.tokenizer().save_pretrained(folder)
    res = onnxmedic.export_pretrained(folder, out / "m", task="text2text-generation")
    _fails_with(res, "OM807", out)


def test_a_task_without_its_cache_is_om807_naming_the_with_past_one():
    """The with-past tasks are the generation roads (onnxmedic.hf.generation is part of
    onnxmedic: no install decides it, so none is refused); a generation task without the
    cache is OM807, its hint the -with-past task where there is one."""
    from onnxmedic.findings import InputError
    from onnxmedic.hf import load
    from onnxmedic.hf.tasks import GENERATION

    for task in GENERATION:
        if task.endswith("-with-past"):
            load.check_generation(task)  # not refused
            continue
        with pytest.raises(InputError) as caught:
            load.check_generation(task)
        finding = caught.value.finding
        assert finding.code == "OM807" and "text-generation-with-past" in finding.message
        with_past = f"{task}-with-past"
        assert (with_past in finding.suggestion) == (with_past in GENERATION), finding


def test_corrupt_weights_are_om808(tmp_path, out, hf_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_folder("bert-cls"), folder)
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    _fails_with(onnxmedic.export_pretrained(folder, out / "m.onnx"), "OM808", out)


def test_unknown_model_type_is_om808(tmp_path, out, hf_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_folder("bert-cls"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "bert_from_the_future"
    (folder / "config.json").write_text(json.dumps(cfg))
    res = onnxmedic.export_pretrained(folder, out / "m.onnx")
    _fails_with(res, "OM808", out)
    assert "bert_from_the_future" in res.errors[0].message


def test_failure_leaves_an_existing_output_as_it_was(hf_folder, tmp_path):
    dest = tmp_path / "m.onnx"
    dest.write_bytes(b"the user's earlier model")
    res = onnxmedic.export_pretrained(hf_folder("bert"), dest, task="image-classification")
    assert _codes(res) == ["OM805"]
    assert dest.read_bytes() == b"the user's earlier model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_report_is_written_for_a_failure(tmp_path, out):
    report = tmp_path / "r.json"
    res = onnxmedic.export_pretrained(tmp_path / "nothing-here", out / "m.onnx", report=report)
    assert _codes(res) == ["OM800"]
    data = json.loads(report.read_text())
    assert [f["code"] for f in data["findings"]] == ["OM800"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="dtype"):
        onnxmedic.export_pretrained("x", dtype="int8")
    with pytest.raises(TypeError, match="model must be"):
        onnxmedic.export_pretrained(3)
    with pytest.raises(TypeError, match="plain nn.Module"):
        onnxmedic.export_pretrained(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unexpected keyword"):
        onnxmedic.export_pretrained("x", input_specs=["2x3"])


# --- the command line ------------------------------------------------------------------------

def test_cli_exit_codes_for_bad_checkpoints(tmp_path, hf_folder, capsys):
    out = tmp_path / "m.onnx"
    assert main(["export", f"hf:{tmp_path / 'missing'}", "-o", str(out)]) == 1
    assert "OM800" in capsys.readouterr().err
    assert main(["export", f"hf:{hf_folder('bert')}", "--task", "nope", "-o", str(out)]) == 2
    assert "OM804" in capsys.readouterr().err
    assert main(["export", f"hf:{hf_folder('bert')}", "--task", "audio-classification",
                 "-o", str(out), "--json"]) == 1
    text = capsys.readouterr().out
    assert "OM805" in text and '"ok": false' in text
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["export", "model.py:M", "--task", "fill-mask"],
    ["export", "model.py:M", "--trust-remote-code"],
    ["export", "hf:some/model", "--input", "2x3"],
    ["export", "hf:some/model", "--dtype", "int4"],
])
def test_cli_flag_misuse_is_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_tokenizer_beyond_the_models_vocabulary_is_om831():
    """Prompt ids at or beyond the model's vocab_size (a tokenizer that is not the model's)
    are the checkpoint's OM831, not PyTorch's IndexError inside generate (OM009)."""
    from onnxmedic.findings import InputError
    from onnxmedic.hf.gen_verify import prompt_ids
    from tests.hf import checkpoints

    tok = checkpoints.tokenizer("bpe")
    assert prompt_ids(tok, ["the cat"], len(tok))  # its own vocabulary: ids as they are
    with pytest.raises(InputError) as e:
        prompt_ids(tok, ["The quick brown fox jumps over the lazy dog"], 8)
    f = e.value.finding
    assert f.code == "OM831" and "vocab_size 8" in f.message and f.details["tokenizer_size"] == len(tok)
    assert prompt_ids(None, ["no tokenizer"], 8)[0]  # seeded ids stay inside the vocabulary
    assert max(prompt_ids(None, ["no tokenizer"], 8)[0]) < 8


@pytest.mark.slow
def test_export_with_a_tokenizer_beyond_the_vocabulary_writes_nothing(tmp_path, out):
    from transformers import AutoModelForCausalLM, GPT2Config

    from tests.hf import checkpoints

    torch.manual_seed(0)
    tok = checkpoints.tokenizer("bpe")
    cfg = GPT2Config(vocab_size=len(tok) - 32, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    res = onnxmedic.export_pretrained(tmp_path / "ckpt", out / "pkg")
    assert not res.ok and "OM831" in _codes(res) and "OM009" not in _codes(res)
    assert res.exit_code == 1 and list(out.iterdir()) == []
