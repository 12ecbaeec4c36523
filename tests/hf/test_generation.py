"""text-generation-with-past packages (onnxmedic.hf.generation): the folder's layout, greedy
generation verified against PyTorch in ONNX Runtime and onnxruntime-genai, and faults caught."""

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

from onnxmedic.hf import (
    export_generation,  # noqa: E402
    gen_verify,  # noqa: E402
)
from onnxmedic.hf.gen_verify import GenerationCheck, judge_prompt, verify_generation  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.zoo.generation import FAMILIES, FAST, build, save_family  # noqa: E402

STEPS = 5


def codes(findings):
    return [f.code for f in findings]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama checkpoint folder with its tokenizer, and its verified package."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("gen")
    folder = save_family("llama", root / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    result = export_generation(model, root / "pkg", tokenizer=tok, steps=STEPS)
    return model, tok, result, root / "pkg"


def test_package_layout_and_generation(llama):
    model, tok, result, pkg = llama
    assert result.ok, [f.one_paragraph() for f in result.errors]
    assert result.path == str(pkg) and result.stages["generate"] == "passed"
    names = {p.name for p in pkg.iterdir()}
    assert {"model.onnx", "genai_config.json", "config.json", "generation_config.json",
            "tokenizer.json"} <= names
    assert not [p for p in pkg.parent.iterdir() if ".tmp-" in p.name]  # no temp folder left
    proto = onnx.load(str(pkg / "model.onnx"))
    ins = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
           for i in proto.graph.input}
    outs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]
            for o in proto.graph.output}
    assert ins["input_ids"] == ["batch_size", "sequence_length"]
    assert ins["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert ins["position_ids"] == ["batch_size", "sequence_length"]
    assert ins["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert outs["present.0.key"] == ["batch_size", 2, "total_sequence_length", 16]
    assert list(outs)[0] == "logits" and len(outs) == 5
    cfg = json.loads((pkg / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert dec["outputs"]["present_value_names"] == "present.%d.value"
    assert (dec["num_key_value_heads"], dec["head_size"], dec["num_hidden_layers"]) == (2, 16, 2)
    # verified as used: both prompts, STEPS tokens each, identical in all three runtimes
    g = result.generation
    assert len(g.tokens_torch) == 2 and all(len(t) == STEPS for t in g.tokens_torch)
    assert g.tokens_onnx == g.tokens_torch
    if gen_verify.genai_available():
        assert g.tokens_genai == g.tokens_torch
    # each step of each prompt judged by the float64 budget
    steps = [c for c in g.comparisons]
    assert len(steps) == 2 * STEPS and all(c.ok and c.rule == "float64 budget" for c in steps)


def test_the_graphs_verification_uses_the_package_names(llama, tmp_path):
    """The graph's own verification (its input sets) names the outputs as the package does,
    in the result, the JSON report and the terminal - not the exported graph's cat_11."""
    import io

    from rich.console import Console

    from onnxmedic.report import write_report
    from onnxmedic.report.terminal import render_terminal

    model, tok, result, pkg = llama
    names = {"logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"}
    assert {c.name for c in result.verification} == names
    write_report(result, tmp_path / "r.json")
    text = (tmp_path / "r.json").read_text()
    assert '"present.1.value"' in text and '"cat_' not in text
    buf = io.StringIO()
    render_terminal(result, Console(file=buf, width=200, soft_wrap=True))
    assert "present.1.value" in buf.getvalue() and "cat_" not in buf.getvalue()


def test_package_names_in_findings_and_comparisons():
    from onnxmedic.findings import error
    from onnxmedic.hf.generation import package_names
    from onnxmedic.result import ExportResult
    from onnxmedic.verify.compare import OutputComparison

    sub = ExportResult(command="export")
    sub.verification.append(OutputComparison("cat_1", "example", [1], [1], "float32",
                                             "float32", 1.0, 1.0, 0, 0, 1, 1, False))
    sub.findings.append(error("OM601", "compare", "output cat_1 (and cat_11, cat_1.x) is off"))
    package_names(sub, {"cat_1": "present.0.key", "linear_3": "logits"})
    assert sub.verification[0].name == "present.0.key"
    assert sub.findings[0].message == "output present.0.key (and cat_11, cat_1.x) is off"


def _corrupt(pkg: Path, dst: Path, output: str, scale: float) -> Path:
    """A copy of the package whose graph output ``output`` is multiplied by ``scale``."""
    shutil.copytree(pkg, dst)
    proto = onnx.load(str(dst / "model.onnx"))
    g = proto.graph
    inner = output + "_before_fault"
    for node in g.node:  # the graph reads the right value; only the output is wrong
        node.output[:] = [inner if n == output else n for n in node.output]
        node.input[:] = [inner if n == output else n for n in node.input]
    g.initializer.append(onnx.numpy_helper.from_array(np.array(scale, np.float32), "fault_k"))
    g.node.append(onnx.helper.make_node("Mul", [inner, "fault_k"], [output]))
    onnx.save(proto, str(dst / "model.onnx"))
    return dst


def test_corrupted_cache_output_is_caught(llama, tmp_path):
    """A present (cache) output off by 2%: the prefill's logits are right, the decode steps
    read the wrong cache - caught at step 1, by onnxmedic's loop and by onnxruntime-genai."""
    model, tok, result, pkg = llama
    bad = _corrupt(pkg, tmp_path / "bad", "present.0.value", 1.02)
    check = verify_generation(bad, model, tok, steps=STEPS, program=result.program)
    assert not check.ok
    first = next(f for f in check.findings if f.code in ("OM811", "OM812"))
    assert check.divergence["prompt"] == 0 and check.divergence["step"] == 1
    assert "step 1" in first.message
    # the prefill step itself (step 0) was within budget
    assert check.comparisons[0].ok and not check.comparisons[1].ok


def test_wrong_tokens_caught_by_both_runtimes(llama, tmp_path):
    """A cache output 10^4 times too large: the tokens differ (OM811), the first ONNX node outside its budget
    at that step is localised, and onnxruntime-genai's tokens differ too (OM814)."""
    model, tok, result, pkg = llama
    bad = _corrupt(pkg, tmp_path / "bad", "present.1.value", 1e4)
    check = verify_generation(bad, model, tok, steps=STEPS, program=result.program)
    assert "OM811" in codes(check.findings), codes(check.findings)
    assert check.tokens_onnx[0] != check.tokens_torch[0]
    if gen_verify.genai_available():
        check.ok = True  # judge the genai run on its own
        gen_verify.genai_generation(bad, check, STEPS, 60.0, set())
        assert "OM814" in codes(check.findings)


def test_divergence_is_localised_to_a_node(llama, tmp_path):
    """A weight of the package's graph scaled by 1 + 1e-2: the first step outside the budget
    is localised like any other mismatch - the first ONNX node outside its budget (OM610)."""
    from onnxmedic.verify.faults import scale_weight

    model, tok, result, pkg = llama
    bad = tmp_path / "bad"
    shutil.copytree(pkg, bad)
    proto = scale_weight(onnx.load(str(bad / "model.onnx")), 1e-2)
    onnx.save(proto, str(bad / "model.onnx"))
    check = verify_generation(bad, model, tok, steps=2, prompts=["Return the"],
                              program=result.program)
    assert not check.ok and check.divergence["step"] == 0
    loc = [f for f in check.findings if f.code == "OM610"]
    assert loc and "prompt 0 step 0" in loc[0].message


def test_big_weights_go_to_external_data(llama, tmp_path, monkeypatch):
    """Over the threshold the weights are written as model.onnx.data; both runtimes load it."""
    from onnxmedic.hf import generation

    model, tok, result, pkg = llama
    monkeypatch.setattr(generation, "EXTERNAL_DATA_THRESHOLD", 0)
    big = tmp_path / "big"
    shutil.copytree(pkg, big, ignore=shutil.ignore_patterns("model.onnx"))
    generation.save_graph(onnx.load(str(pkg / "model.onnx")), big)
    assert (big / "model.onnx.data").stat().st_size > (big / "model.onnx").stat().st_size
    check = verify_generation(big, model, tok, steps=2, prompts=["Return the"])
    assert check.ok and check.tokens_onnx == check.tokens_torch
    if gen_verify.genai_available():
        assert check.tokens_genai == check.tokens_torch


def test_external_weights_are_moved_into_the_package(llama, tmp_path):
    """The export's external data file becomes model.onnx.data (moved, not rewritten); the
    graph points at it and generates as before."""
    from onnxmedic.hf import generation

    model, tok, result, pkg = llama
    raw = tmp_path / "graph" / "decoder.onnx"
    raw.parent.mkdir()
    onnx.save_model(onnx.load(str(pkg / "model.onnx")), raw, save_as_external_data=True,
                    location="decoder.onnx.data", size_threshold=256)  # as the export writes
    data = (raw.parent / "decoder.onnx.data").stat()
    out = tmp_path / "pkg"
    shutil.copytree(pkg, out, ignore=shutil.ignore_patterns("model.onnx"))
    generation.package_graph(raw, out)
    assert not (raw.parent / "decoder.onnx.data").exists()
    moved = (out / "model.onnx.data").stat()
    assert (moved.st_ino, moved.st_size) == (data.st_ino, data.st_size)
    check = verify_generation(out, model, tok, steps=2, prompts=["Return the"])
    assert check.ok and check.tokens_onnx == check.tokens_torch


def test_genai_config_that_does_not_match_the_graph(llama, tmp_path):
    if not gen_verify.genai_available():
        pytest.skip("onnxruntime-genai not installed")
    model, tok, result, pkg = llama
    bad = tmp_path / "bad"
    shutil.copytree(pkg, bad)
    cfg = json.loads((bad / "genai_config.json").read_text())
    cfg["model"]["decoder"]["inputs"]["past_key_names"] = "past.%d.k"
    (bad / "genai_config.json").write_text(json.dumps(cfg))
    check = GenerationCheck(prompts=[[5, 6, 7]], tokens_torch=[[1, 2]])
    gen_verify.genai_generation(bad, check, 2, 60.0, set())
    assert not check.ok and codes(check.findings) == ["OM816"]


def test_genai_missing_is_said(llama, monkeypatch):
    model, tok, result, pkg = llama
    monkeypatch.setattr(gen_verify, "genai_available", lambda: False)
    check = GenerationCheck(prompts=[[5, 6, 7]], tokens_torch=[[1, 2]])
    gen_verify.genai_generation(pkg, check, 2, 60.0, set())
    assert check.ok and codes(check.findings) == ["OM815"]


def test_a_tie_is_not_a_failure_but_a_wrong_token_is():
    """Tokens that differ where the logits are within the float64 budget: a greedy tie
    (OM813, warning); the same tokens with logits far off: OM811."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 1, 16))
    ref[0, 0, 3] = ref[0, 0, 7] = 5.0  # an exact tie in float64
    exp = (ref + 1e-7 * rng.standard_normal(ref.shape)).astype(np.float32)
    act = (ref + 1e-7 * rng.standard_normal(ref.shape)).astype(np.float32)
    exp[0, 0, 3] += np.float32(1e-6)
    act[0, 0, 7] += np.float32(1e-6)
    check = GenerationCheck()
    assert judge_prompt(check, 0, 4, [3], [7], [exp], [act], [ref]) is None
    assert check.ok and codes(check.findings) == ["OM813"]
    check = GenerationCheck()
    far = act.copy()
    far[0, 0, 7] += 1.0
    assert judge_prompt(check, 0, 4, [3], [7], [exp], [far], [ref]) == 0
    assert not check.ok and codes(check.findings) == ["OM811"]


def test_not_a_decoder(tmp_path):
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, vocab_size=64)).eval()
    r = export_generation(bert, tmp_path / "pkg", report=tmp_path / "report.json")
    assert not r.ok and codes(r.errors) == ["OM817"] and r.exit_code == 1
    assert not (tmp_path / "pkg").exists()
    report = json.loads((tmp_path / "report.json").read_text())
    assert "OM817" in json.dumps(report["findings"])


def test_failed_graph_export_writes_nothing(tmp_path, monkeypatch):
    """ONNX Runtime crashing on the graph (an injected abort): OM810, the existing folder is
    left as it was, no temp folder is left."""
    monkeypatch.setenv("ONNXMEDIC_SANDBOX_FAULT", "abort:run")
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    r = export_generation(build("gpt2"), out, steps=2)
    assert not r.ok and {"OM810", "OM818"} <= set(codes(r.errors))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in FAST])
def test_family_sweep(family, tmp_path):
    _family(family, tmp_path)


@pytest.mark.parametrize("family", [f for f in FAST if f != "llama"])
def test_fast_families(family, tmp_path):
    _family(family, tmp_path)


def _family(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_family(family, tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    r = export_generation(model, tmp_path / "pkg", tokenizer=tok, steps=STEPS, prompts=[
        "Return the number of items"])
    assert r.ok, [f.one_paragraph() for f in r.errors]
    g = r.generation
    assert g.tokens_onnx == g.tokens_torch
    if family == "deepseek_v3":  # keys and values of different head sizes: no genai_config
        assert "OM820" in codes(r.findings) and g.tokens_genai is None
        assert not (tmp_path / "pkg" / "genai_config.json").exists()
    elif family in ("lfm2", "falcon_h1", "mamba"):  # states, one token per step: own loop
        assert "OM829" in codes(r.findings) and g.tokens_genai is None
    elif gen_verify.genai_available():  # onnxruntime-genai stops at the model's EOS
        eos = model.generation_config.eos_token_id
        eos = set(eos) if isinstance(eos, list) else {eos}
        assert g.tokens_genai == [t[:len(n)] if n and n[-1] in eos else t
                                  for n, t in zip(g.tokens_genai, g.tokens_torch)]
    assert torch.is_grad_enabled()


def test_genai_problem_names_a_cache_genai_cannot_size():
    from onnxmedic.hf.generation import genai_problem

    same = [torch.zeros(1, 2, 3, 16)] * 4
    assert genai_problem(same) is None
    mla = [torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 8)] * 2
    assert "keys [(1, 16)] and values [(1, 8)]" in genai_problem(mla)


def test_only_past_plus_new_is_named_total_sequence_length():
    """gpt-oss concatenates an attention-sink column to its scores: past + new + 1 columns.
    Named total_sequence_length too, ONNX Runtime reused a buffer one column short (a Concat
    shape mismatch at the first step, OM511)."""
    from onnx import TensorProto, helper

    from onnxmedic.hf.generation import rename_io

    def info(name, *dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))

    new, past = "sequence_length", "past_sequence_length"
    nodes = [helper.make_node("Identity", ["k"], ["pk"]), helper.make_node("Identity", ["v"],
                                                                           ["pv"])]
    graph = helper.make_graph(
        nodes, "g", [info("input_ids", "b", new), info("attention_mask", "b", "t"),
                     info("k", "b", 2, past, 4), info("v", "b", 2, past, 4)],
        [info("logits", "b", new, 8), info("pk", "b", 2, f"{past} + {new}", 4),
         info("pv", "b", 2, f"{new} + {past}", 4)],
        value_info=[info("sinks", "b", 2, new, f"{past} + {new} + 1")])
    proto = helper.make_model(graph)
    rename_io(proto)
    dims = {v.name: [d.dim_param for d in v.type.tensor_type.shape.dim]
            for v in list(proto.graph.output) + list(proto.graph.value_info)}
    assert dims["present.0.key"][2] == dims["present.0.value"][2] == "total_sequence_length"
    assert dims["sinks"][3] == f"{past} + {new} + 1"


def _graph(op: str, domain: str = "", in_function: bool = False) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    node = helper.make_node(op, ["x", "w"], ["y"], domain=domain)
    io = dict(inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
              outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], [0.0] * 16)
    if not in_function:
        return helper.make_model(helper.make_graph([node], "g", initializer=[w], **io))
    fn = helper.make_function("local", "F", ["x", "w"], ["y"], [node],
                              [helper.make_opsetid(domain, 1)])
    call = helper.make_node("F", ["x", "w"], ["y"], domain="local")
    return helper.make_model(helper.make_graph([call], "g", initializer=[w], **io),
                             functions=[fn])


def test_weights_are_packed_at_load_only_where_they_are_quantized(llama, tmp_path):
    """The verification's sessions pack MatMul weights only where they are quantized (packed,
    MatMulNBits computes otherwise); a float package is loaded unpacked, by the own loop and
    by onnxruntime-genai alike (its spec says so)."""
    assert not gen_verify.quantized_weights(_graph("MatMul"))
    assert gen_verify.quantized_weights(_graph("MatMulNBits", "com.microsoft"))
    assert gen_verify.quantized_weights(_graph("DequantizeLinear", in_function=True))
    prompts = [[5, 6, 7]]
    spec = json.loads(gen_verify.genai_spec(llama[3], prompts, 4))
    assert spec == {"prompts": prompts, "steps": 4, "prepack": False}
    assert not gen_verify.quantized_file(llama[3] / "model.onnx")
    onnx.save(_graph("MatMulNBits", "com.microsoft"), str(tmp_path / "model.onnx"))
    assert json.loads(gen_verify.genai_spec(tmp_path, prompts, 4))["prepack"] is True
    # unreadable here: packed as where it is served; the child says what is wrong with it
    assert json.loads(gen_verify.genai_spec(tmp_path / "none", prompts, 4))["prepack"] is True
    if gen_verify.genai_available():  # the child loads the folder either way, same tokens
        runs = [gen_verify.finish_genai_child(gen_verify.start_genai_child(
            llama[3], json.dumps({**spec, "prepack": p})), 120,
            GenerationCheck()) for p in (False, True)]
        assert runs[0] and runs[0]["tokens"] == runs[1]["tokens"]
        assert len(runs[0]["tokens"][0]) == 4


# ------------------------------------------------------------------------------------------
# the package's fast path (#40): ONNX Runtime's fusions and int4, each a verified candidate


def test_fused_package_is_verified_and_served(llama, tmp_path, monkeypatch, capsys):
    from onnxmedic.cli import main
    from onnxmedic.hf.transforms import fuse_decoder

    model, tok, _, pkg = llama
    results = []
    real = fuse_decoder.fuse_package

    def spy(*a, **kw):
        results.append(real(*a, **{**kw, "steps": STEPS}))
        return results[-1]

    monkeypatch.setattr(fuse_decoder, "fuse_package", spy)
    rc = main(["optimize", str(pkg), f"hf:{pkg.parent / 'ckpt' / 'llama'}", "-o",
               str(tmp_path / "fused")])
    r = results[0]
    assert rc == 0 and r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM734" in codes(r.findings) and "OM734" in capsys.readouterr().out
    assert r.folded_where >= 1
    # the RMS norms (with the residual) and each layer's attention with its rotary embedding
    # and KV cache are ONNX Runtime's fused ops; genai updates the cache in place
    assert r.ops.get("SkipSimplifiedLayerNormalization", 0) >= 2
    assert r.ops.get("GroupQueryAttention", 0) == model.config.num_hidden_layers
    graph = onnx.load(str(tmp_path / "fused" / "model.onnx")).graph
    assert {"Pow", "ReduceMean", "Softmax", "Cos", "GatherND"}.isdisjoint(
        n.op_type for n in graph.node)
    # the output projection reads the attention output itself (no heads' Reshape/Transpose)
    attn = {n.output[0] for n in graph.node if n.op_type == "GroupQueryAttention"}
    assert {n.op_type for n in graph.node if set(n.input) & attn} == {"MatMul"}
    cfg = json.loads((tmp_path / "fused" / "genai_config.json").read_text())
    assert cfg["search"]["past_present_share_buffer"] is True
    assert r.check.tokens_onnx == r.check.tokens_torch
    if gen_verify.genai_available():
        assert r.check.tokens_genai == r.check.tokens_torch
    assert {p.name for p in pkg.iterdir()} <= {p.name for p in (tmp_path / "fused").iterdir()}


@pytest.mark.parametrize("fault", ["rotary cache", "kv heads"])
def test_fused_package_with_a_fault_is_rejected(llama, tmp_path, fault):
    from onnxmedic.hf.transforms.fuse_decoder import fuse_package

    model, tok, _, pkg = llama

    def wrong_rotary(proto):  # GroupQueryAttention's sin cache 2 % off
        t = next(i for i in proto.graph.initializer if i.name == "gqa/sin_cache")
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * 1.02, t.name))

    def wrong_kv_heads(proto):  # one KV head fewer than the cache has
        for n in proto.graph.node:
            if n.op_type == "GroupQueryAttention":
                a = next(a for a in n.attribute if a.name == "kv_num_heads")
                a.i -= 1

    mutate = wrong_rotary if fault == "rotary cache" else wrong_kv_heads
    r = fuse_package(pkg, tmp_path / "fused", model, tok, steps=STEPS, mutate=mutate)
    assert not r.ok and "OM735" in codes(r.findings)
    # the figure: the step's logits outside the budget; ONNX Runtime's refusal to run
    want = {"OM811", "OM812"} if fault == "rotary cache" else {"OM510", "OM511"}  # load/run
    assert want & set(codes(r.findings)), codes(r.findings)
    assert not (tmp_path / "fused").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_package_without_its_model_is_refused(llama, tmp_path, capsys):
    """No checkpoint folder: OM800, as export hf: says it; a checkpoint that is no causal LM
    (an encoder-decoder's): OM737. Nothing is written either way."""
    from transformers import T5Config, T5ForConditionalGeneration

    from onnxmedic.cli import main

    rc = main(["optimize", str(llama[3]), f"hf:{tmp_path / 'nowhere'}", "-o",
               str(tmp_path / "out")])
    assert rc == 1 and "OM800" in capsys.readouterr().err
    T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                        d_kv=8, vocab_size=64)).save_pretrained(tmp_path / "t5")
    rc = main(["optimize", str(llama[3]), f"hf:{tmp_path / 't5'}", "-o", str(tmp_path / "out")])
    assert rc == 1 and "OM737" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_int4_package_outside_the_budget_writes_nothing(llama, tmp_path):
    from onnxmedic.hf.transforms.int4_package import int4_package
    from onnxmedic.optimize.int4 import TaskBudget

    model, tok, _, pkg = llama
    # random weights: near-uniform logits, every 4-bit head flips greedy picks
    r = int4_package(pkg, tmp_path / "int4", model, tok, grid=[(32, 4, "int4")], search=False,
                     budget=TaskBudget(steps=8, prompts=2))
    assert not r.ok and "OM731" in codes(r.findings)
    assert not (tmp_path / "int4").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not gen_verify.genai_available(), reason="needs onnxruntime-genai")
def test_int4_package_genai_cannot_serve_writes_nothing(llama, tmp_path):
    from onnxmedic.hf.transforms.int4_package import int4_package
    from onnxmedic.optimize.int4 import TaskBudget

    model, tok, _, pkg = llama
    bad = tmp_path / "pkg"
    shutil.copytree(pkg, bad)
    cfg = json.loads((bad / "genai_config.json").read_text())
    cfg["model"]["decoder"]["inputs"]["past_key_names"] = "past.%d.key"  # a stale config
    (bad / "genai_config.json").write_text(json.dumps(cfg))
    loose = TaskBudget(perplexity=100.0, agreement=0.01, steps=4, prompts=1)
    r = int4_package(bad, tmp_path / "int4", model, tok, grid=[(32, 4, "int4")], search=False,
                     budget=loose)
    assert r.search.ok and not r.ok and "OM736" in codes(r.findings)
    assert not (tmp_path / "int4").exists()
    # the chosen candidate is said (OM732) but not as written: nothing was, anywhere
    om732 = next(f for f in r.findings if f.code == "OM732")
    assert r.search.written is None and "written to" not in om732.message, om732.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


@pytest.mark.slow
def test_int4_package_is_served_by_genai(llama, tmp_path):
    from onnxmedic.hf.transforms.int4_package import int4_package
    from onnxmedic.optimize.int4 import TaskBudget

    model, tok, _, pkg = llama
    r = int4_package(pkg, tmp_path / "int4", model, tok, grid=[(32, 0, "fp32")], search=True,
                     budget=TaskBudget(steps=16, prompts=2))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM732" in codes(r.findings)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "int4" / "model.onnx")).graph.node}
    assert "MatMulNBits" in ops
    assert json.loads((tmp_path / "int4" / "genai_config.json").read_text()) == json.loads(
        (pkg / "genai_config.json").read_text())
    if gen_verify.genai_available():
        assert r.tokens_genai == r.tokens_onnx


# ------------------------------------------------------------------------------------------
# export --optimize on a generation package: the fused package in one command (#39)


def test_export_optimize_writes_the_fused_package(llama, tmp_path, monkeypatch):
    model, tok, _, _ = llama
    runs = []
    real = gen_verify.torch_generation
    monkeypatch.setattr(gen_verify, "torch_generation", lambda *a: runs.append(1) or real(*a))
    r = export_generation(model, tmp_path / "pkg", tokenizer=tok, steps=STEPS,
                          prompts=["Return the"], optimize=True)
    assert r.ok and "OM734" in codes(r.findings), [f.one_paragraph() for f in r.findings]
    fused = next(f for f in r.findings if f.code == "OM734")
    assert f"written to {tmp_path / 'pkg'}:" in fused.message
    ops = {n.op_type for n in onnx.load(str(tmp_path / "pkg" / "model.onnx"),
                                        load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    cfg = json.loads((tmp_path / "pkg" / "genai_config.json").read_text())
    assert cfg["search"]["past_present_share_buffer"] is True
    assert runs == [1]  # PyTorch generated once: the fused package judged by the same run
    assert r.timings["optimize"] > 0 and r.stages["generate"] == "passed"
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]  # no temporary folder left


@pytest.mark.slow
def test_export_optimize_keeps_the_plain_package_when_the_fused_one_is_wrong(
        llama, tmp_path, monkeypatch):
    from onnxmedic.hf.transforms import fuse_decoder

    model, tok, _, _ = llama
    real = fuse_decoder.fuse_graph

    def wrong_rotary(src, dst, **kw):  # GroupQueryAttention's sin cache 2 % off
        out = real(src, dst, **kw)
        proto = onnx.load(str(dst))
        t = next(i for i in proto.graph.initializer if i.name == "gqa/sin_cache")
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t) * 1.02, t.name))
        onnx.save(proto, str(dst))
        return out

    monkeypatch.setattr(fuse_decoder, "fuse_graph", wrong_rotary)
    r = export_generation(model, tmp_path / "pkg", tokenizer=tok, steps=STEPS,
                          prompts=["Return the"], optimize=True)
    rejected = [f for f in r.findings if f.code == "OM735"]
    assert r.ok and rejected and rejected[0].severity == "warning", codes(r.findings)
    assert "first divergence" in rejected[0].message and "plain package" in rejected[0].message
    assert f"not written to {tmp_path / 'pkg'}:" in rejected[0].message
    ops = {n.op_type for n in onnx.load(str(tmp_path / "pkg" / "model.onnx")).graph.node}
    assert "GroupQueryAttention" not in ops  # the plain package, verified, is written
    if gen_verify.genai_available():  # and onnxruntime-genai generated from it
        assert r.generation.tokens_genai == r.generation.tokens_torch
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_export_optimize_at_another_precision_is_said(llama, tmp_path):
    from onnxmedic.hf import export_pretrained

    model, tok, _, _ = llama
    r = export_pretrained(model, tmp_path / "pkg", task="text-generation-with-past",
                          verify=False, optimize=True, precision="fp16")
    said = [f for f in r.findings if f.code == "OM835"]
    assert said and "--precision int4" in said[0].message, codes(r.findings)
    assert r.path == str(tmp_path / "pkg") and "OM734" not in codes(r.findings)


def test_pytorch_generates_every_step_past_the_models_own_eos():
    """The verification's PyTorch run is greedy search alone, N tokens always: transformers
    fills the passed config's unset eos_token_id from the model's generation_config, so a
    model whose config names the token it generates stopped there (a tiny Qwen3-MoE: 2
    PyTorch tokens against 5 from ONNX Runtime, while the export said verified)."""
    from onnxmedic.hf.gen_verify import torch_generation

    model = build("gpt2")
    ids = [5, 6, 7, 8]
    first, _ = torch_generation(model, ids, 1)
    model.generation_config.eos_token_id = first[0]
    tokens, logits = torch_generation(model, ids, 4)
    assert len(tokens) == 4 and tokens[0] == first[0] and len(logits) == 4
    assert model.generation_config.eos_token_id == first[0]  # the model's own, given back
