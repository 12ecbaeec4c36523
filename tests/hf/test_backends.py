"""onnxruntime-genai's model builder as a backend of text-generation-with-past
(onnxmedic.hf.backends; the builder's child: onnxmedic.hf.builder): its package is written
only when onnxmedic verifies it (OM836); a failing builder or a wrong package falls back to
onnxmedic's own export (OM837), or is an error with backend="builder" (OM838)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

pytest.importorskip("transformers")

import onnxmedic  # noqa: E402
from onnxmedic.hf import backends, builder, gen_verify  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.zoo.generation import save_family  # noqa: E402

needs_builder = pytest.mark.skipif(not builder.available(),
                                   reason="onnxruntime-genai's model builder not installed")
TASK = "text-generation-with-past"


def codes(result):
    return [f.code for f in result.findings]


def ops(folder):
    return {n.op_type for n in onnx.load(str(folder / "model.onnx"),
                                         load_external_data=False).graph.node}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_family("qwen2", tmp_path_factory.mktemp("builder") / "ckpt")


@pytest.fixture(scope="module")
def built(qwen2, tmp_path_factory):
    """(result, folder) of the default backend's (auto: the builder's) package of qwen2."""
    root = tmp_path_factory.mktemp("auto")
    return onnxmedic.export_pretrained(qwen2, root / "pkg", task=TASK), root


@needs_builder
def test_auto_writes_the_builders_package_once_verified(built):
    r, tmp_path = built
    assert r.ok and "OM836" in codes(r), [f.one_paragraph() for f in r.findings]
    said = next(f for f in r.findings if f.code == "OM836")
    assert "GroupQueryAttention x" in said.message
    assert r.stages == {"build": "passed", "write": "passed", "generate": "passed"}
    pkg = tmp_path / "pkg"
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops(pkg)
    assert {"genai_config.json", "config.json", "generation_config.json",
            "tokenizer.json", "model.onnx"} <= {p.name for p in pkg.iterdir()}
    g = r.generation
    assert g.ok and g.tokens_onnx == g.tokens_torch and len(g.tokens_torch[0]) == 8
    assert g.tokens_genai == g.tokens_torch
    # every step's logits judged against the float64 reference, as for onnxmedic's own
    assert r.verification and all(c.ok and c.rule == "float64 budget" for c in r.verification)
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]  # no builder folder left


def _wrong_layernorm(real):
    """finish() then the builder's first layer norm 5 % off: a package that loads and runs
    but computes other numbers."""

    def finish(job, model, tokenizer):
        files = real(job, model, tokenizer)
        proto = onnx.load(str(job.out / "model.onnx"))
        t = next(i for i in proto.graph.initializer if "layernorm" in i.name.lower()
                 or "norm" in i.name.lower())
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * 1.05, t.name))
        onnx.save(proto, str(job.out / "model.onnx"), save_as_external_data=True,
                  location="model.onnx.data")
        return files

    return finish


@needs_builder
def test_a_wrong_builder_package_is_caught_and_the_export_writes_instead(
        qwen2, tmp_path, monkeypatch):
    monkeypatch.setattr(builder, "finish", _wrong_layernorm(builder.finish))
    r = onnxmedic.export_pretrained(qwen2, tmp_path / "pkg", task=TASK)
    fell = [f for f in r.findings if f.code == "OM837"]
    assert r.ok and fell and fell[0].severity == "warning", codes(r)
    assert "does not verify" in fell[0].message and "OM836" not in codes(r)
    assert "GroupQueryAttention" not in ops(tmp_path / "pkg")  # onnxmedic's own export
    assert r.stages["capture"] == "passed" and r.stages["generate"] == "passed"
    assert r.generation.tokens_onnx == r.generation.tokens_torch
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


@needs_builder
def test_backend_builder_writes_nothing_when_its_package_is_wrong(qwen2, tmp_path, monkeypatch):
    monkeypatch.setattr(builder, "finish", _wrong_layernorm(builder.finish))
    r = onnxmedic.export_pretrained(qwen2, tmp_path / "pkg", task=TASK, backend="builder")
    assert not r.ok and "OM838" in codes(r) and r.exit_code == 1, codes(r)
    # the divergence itself is reported, as for any package
    assert {"OM811", "OM812"} & set(codes(r)) and "OM818" in codes(r)
    assert list(tmp_path.iterdir()) == []


@needs_builder
def test_a_builder_that_fails_is_said_with_its_error(tmp_path, monkeypatch):
    """GPT-2 has no builder class: with backend="builder" the builder runs and fails."""
    folder = save_family("gpt2", tmp_path / "ckpt")
    monkeypatch.setattr(builder, "ARCHITECTURES",
                        builder.ARCHITECTURES | {"GPT2LMHeadModel"})
    out = tmp_path / "out"
    out.mkdir()
    r = onnxmedic.export_pretrained(folder, out / "pkg", task=TASK, backend="builder")
    err = [f for f in r.errors if f.code == "OM838"]
    assert err and "exited with 1" in err[0].message and "not currently supported" in \
        err[0].message, codes(r)
    assert list(out.iterdir()) == []


def test_backend_builder_refuses_what_it_cannot_build(qwen2, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2)
    r = onnxmedic.export_pretrained(model, tmp_path / "pkg", task=TASK, backend="builder")
    assert codes(r) == ["OM838"] and "object" in r.errors[0].message
    r = onnxmedic.export_pretrained(qwen2, tmp_path / "pkg", task=TASK, backend="builder",
                                    dtype="fp16")
    assert codes(r) == ["OM838"] and "fp16" in r.errors[0].message and r.exit_code == 1
    monkeypatch.setattr(builder, "available", lambda: False)
    r = onnxmedic.export_pretrained(qwen2, tmp_path / "pkg", task=TASK, backend="builder")
    assert codes(r) == ["OM838"] and "pip install onnxruntime-genai" in r.errors[0].message
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="backend must be one of"):
        onnxmedic.export_pretrained(qwen2, tmp_path / "pkg", task=TASK, backend="genai")


def test_when_auto_leaves_the_builder_out():
    cfg = {"architectures": ["Qwen2ForCausalLM"]}
    kw = dict(folder=Path("."), dtype="fp32", verify=True, opset=None, remote_code=False)
    available = builder.available()
    assert (backends.why_not(cfg, backend="auto", **kw) is None) == available
    assert "export" in backends.why_not(cfg, backend="export", **kw)
    if available:
        assert "has no model class for GPT2LMHeadModel" in backends.why_not(
            {"architectures": ["GPT2LMHeadModel"]}, backend="auto", **kw)
    assert "verif" in backends.why_not(cfg, backend="auto", **{**kw, "verify": False})
    if available:  # "builder" tries what auto leaves out as not served
        assert backends.why_not({"architectures": ["GPT2LMHeadModel"]},
                                   backend="builder", **kw) is None


@needs_builder
def test_auto_asks_the_installed_builder_what_it_serves():
    """The families the fixed list lacks but the installed builder has a class for (LFM2,
    gpt-oss, ERNIE 4.5, Hunyuan) are tried by auto; GPT-2, which it has none for, is not."""
    served = builder.served()
    assert {"Lfm2ForCausalLM", "GptOssForCausalLM", "Ernie4_5ForCausalLM",
            "HunYuanDenseV1ForCausalLM"} <= served and not served & {"GPT2LMHeadModel"}
    assert not {"Lfm2ForCausalLM", "GptOssForCausalLM"} & builder.ARCHITECTURES
    kw = dict(folder=Path("."), dtype="fp32", verify=True, opset=None, remote_code=False)
    assert backends.why_not({"architectures": ["Lfm2ForCausalLM"]}, backend="auto",
                            **kw) is None


@needs_builder
@pytest.mark.slow
def test_auto_builds_lfm2_with_the_builder_and_verifies_its_states(tmp_path):
    """LFM2 is not in the fixed list, but the installed builder serves it: auto's package is
    the builder's (past.{i}.conv beside the keys and values, the whole prompt at once),
    verified token by token in onnxmedic's loop and in onnxruntime-genai (OM836)."""
    from onnxmedic import genpackage

    folder = save_family("lfm2", tmp_path / "ckpt")
    r = onnxmedic.export_pretrained(folder, tmp_path / "pkg", task=TASK)
    found = [f.code for f in r.findings]
    assert r.ok and "OM836" in found, found
    assert r.generation.tokens_genai == r.generation.tokens_onnx == r.generation.tokens_torch
    layout = genpackage.read_package(tmp_path / "pkg")
    assert layout.states and layout.step_tokens is None


def _gqa_package(folder: Path, **attrs) -> Path:
    """A package folder whose model.onnx is one GroupQueryAttention with ``attrs``."""
    from onnx import TensorProto, helper

    folder.mkdir()
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_len"]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key",
                            "present_value"], name="layers.0/attn", domain="com.microsoft",
                            num_heads=4, kv_num_heads=2, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        n, TensorProto.FLOAT, None) for n in names], [helper.make_tensor_value_info(
            n, TensorProto.FLOAT, None) for n in node.output])
    onnx.save(helper.make_model(graph), str(folder / builder.GRAPH))
    return folder


def test_a_builder_package_the_own_loop_cannot_feed_is_said_before_it_runs(
        tmp_path, monkeypatch):
    """The builder's sliding-window GroupQueryAttention (sliding_window_cache: a buffer of the
    window's capacity shared between past and present, which onnxruntime-genai manages; its
    Gemma 2 and gpt-oss packages) is not run in onnxmedic's loop, which feeds a cache growing
    from empty (ONNX Runtime's "KV cache capacity (0)" error, said as the package not
    verifying): the builder's verdict says so, nothing is run; a window without that cache is
    run."""
    from types import SimpleNamespace

    sliding = _gqa_package(tmp_path / "sliding", local_window_size=8, sliding_window_cache=1)
    assert "onnxmedic's loop does not feed" in backends.unfed_cache(sliding)
    assert "window 8" in backends.unfed_cache(sliding)
    assert backends.unfed_cache(_gqa_package(tmp_path / "plain", local_window_size=8)) is None
    assert backends.unfed_cache(tmp_path / "missing") is None  # the verification says it
    ran = []
    monkeypatch.setattr(builder, "finish", lambda job, model, tok: [])
    monkeypatch.setattr(gen_verify, "genai_beside", lambda *a: ran.append("genai"))
    monkeypatch.setattr(gen_verify, "onnx_side", lambda *a: ran.append("onnx"))
    job = SimpleNamespace(out=sliding, wait=lambda timeout: None)
    req = SimpleNamespace(timeout=1.0, model=None, tokenizer=None, steps=1)
    watch = backends.BuildWatch(job, req, [[1, 2]])
    watch._run()
    assert watch.why.startswith("onnxmedic's own loop cannot verify its package: its "
                                "sliding-window layers") and ran == []


def test_served_falls_back_to_the_fixed_list(monkeypatch):
    """A builder whose source names no architecture (another layout): the fixed list."""
    import importlib.util

    builder.served.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    try:
        assert builder.served() == builder.ARCHITECTURES
    finally:
        monkeypatch.undo()
        builder.served.cache_clear()


def test_the_second_default_prompt_is_for_small_models_only():
    import torch

    small, big = torch.nn.Linear(4, 4), torch.nn.Module()
    big.w = torch.nn.Parameter(torch.empty(gen_verify.SECOND_PROMPT_MAX_PARAMS + 1,
                                           device="meta"))
    assert gen_verify.default_prompts(small) == list(gen_verify.DEFAULT_PROMPTS[:2])
    assert gen_verify.default_prompts(big) == list(gen_verify.DEFAULT_PROMPTS[:1])


def test_cli_backend_goes_with_hf_models_only(capsys):
    from onnxmedic.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["export", "model.py:Net", "--backend", "builder"])
    assert exit_.value.code == 2
    assert "--backend goes only with hf: models" in capsys.readouterr().err


@needs_builder
def test_the_command_starts_the_builder_before_loading_the_exporter(qwen2, tmp_path):
    """The builder is the longest step: the command forks it as soon as the checkpoint's
    config is read, with torch and transformers loaded (its child shares them) but not
    onnxmedic.api, onnxscript or onnx-ir, which load while it writes."""
    probe = (
        "import sys, json\n"
        "from onnxmedic.hf import builder\n"
        "def start(folder, dest):\n"
        "    mods = ['torch', 'transformers', 'onnxmedic.api', 'onnx_ir', 'onnxscript']\n"
        "    print(json.dumps({m: m in sys.modules for m in mods}), flush=True)\n"
        "    raise SystemExit(0)\n"
        "builder.start = start\n"
        "from onnxmedic.cli import main\n"
        f"main(['export', 'hf:{qwen2}', '--task', '{TASK}', '-o', '{tmp_path / 'pkg'}'])\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {"torch": True, "transformers": True, "onnxmedic.api": False,
                      "onnx_ir": False, "onnxscript": False}, out.stderr


def test_the_backend_is_read_in_one_place(tmp_path):
    """backends.Backend: the only reader of ``backend`` (what export_pretrained and the
    command pass on): its validity, whether the builder is started, whether its failure is
    final, and the OM838 of a builder asked for a package it was not started on."""
    assert backends.Backend("builder").strict and not backends.Backend().strict
    with pytest.raises(ValueError, match="backend must be one of auto, export, builder"):
        backends.Backend("genai")
    ckpt = type("Ckpt", (), {"config": {"architectures": ["Qwen2ForCausalLM"]},
                             "folder": tmp_path, "spec": "hf:x", "remote_code": False})()
    assert backends.Backend("export").starter(tmp_path / "pkg", "fp32", True, None)(
        ckpt, TASK) is None
    assert backends.Backend("auto").starter(tmp_path / "pkg", "fp32", True, None)(
        ckpt, "text-classification") is None
    with pytest.raises(onnxmedic.findings.InputError) as err:
        backends.Backend("builder").starter(tmp_path / "pkg", "fp16", True, None)(ckpt, TASK)
    assert err.value.finding.code == "OM838" and "fp16" in err.value.finding.message
    refused = backends.Backend("builder").refusal(TASK, None, "LlamaForCausalLM", False)
    assert refused.code == "OM838" and "object" in refused.message
    assert backends.Backend("auto").refusal(TASK, None, "x", False) is None


@needs_builder
def test_int4_of_the_builders_package(qwen2, built, tmp_path):
    """The builder's cache has a symbolic head size (kv_cache_dim): int4 reads it from the
    package's genai_config.json through the contract (it crashed with a ValueError there),
    and onnxruntime-genai serves the result. (Fusion and int4 together on builder packages:
    test_package_transforms.py, slow.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onnxmedic.genpackage import read_package
    from onnxmedic.hf.transforms.int4_package import int4_package
    from onnxmedic.optimize.int4 import TaskBudget

    pkg = built[1] / "pkg"
    layout = read_package(pkg)
    assert layout.unsized() == [] and layout.sizes_from.endswith("genai_config.json")
    model = AutoModelForCausalLM.from_pretrained(qwen2).eval()
    r = int4_package(pkg, tmp_path / "int4", model, AutoTokenizer.from_pretrained(qwen2),
                     grid=[(32, 4, "int4")], search=False,
                     budget=TaskBudget(agreement=0.9, steps=8, prompts=2))
    assert r.ok, [f.message for f in r.findings]
    assert r.tokens_genai == r.tokens_onnx
    assert {"MatMulNBits", "GroupQueryAttention"} <= ops(tmp_path / "int4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4"]
