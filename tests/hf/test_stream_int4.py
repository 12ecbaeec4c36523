"""An int4 package made and judged streamed (onnxmedic.hf.transforms.stream_int4): the package
written is the quantizer's layout, served by onnxruntime-genai; a corrupted 4-bit block, a wrong scale
(OM870) and a float32 weight gone wrong beside the 4-bit ones (OM871) are refused, nothing
written."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")

from onnxmedic.hf.transforms import stream_int4  # noqa: E402
from onnxmedic.optimize import int4  # noqa: E402

# the tiny random checkpoint's greedy tokens are near-ties (85 % agree at int4): the rule
# judged here is each check's, the default budget is the real checkpoints'
LOOSE = "agreement=60%,steps=8,prompts=2"


def _edit(path, pick, edit) -> None:
    """The first initializer of the decoder at ``path`` that ``pick(name)`` selects,
    rewritten in place as ``edit(array)`` (its external data too)."""
    proto = onnx.load(str(path))
    t = next(t for t in proto.graph.initializer if pick(t.name))
    t.CopyFrom(onnx.numpy_helper.from_array(edit(onnx.numpy_helper.to_array(t).copy()), t.name))
    onnx.save(proto, str(path), save_as_external_data=True, location=f"{path.name}.data")


@pytest.fixture
def matmul_package(tmp_path):
    """A folder whose decoder graph (model.onnx, weights in model.onnx.data) is two MatMuls
    of constant float32 weights: what the quantization and its rounding rule read, without
    the builder's package (the fault tests stop before any generation)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32) * 0.02,
                                 "layers.0.mlp.up_proj.MatMul.weight")
    w2 = numpy_helper.from_array(rng.standard_normal((96, 64)).astype(np.float32) * 0.02,
                                 "layers.0.mlp.down_proj.MatMul.weight")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", w1.name], ["h"], name="/up_proj/MatMul"),
         helper.make_node("MatMul", ["h", w2.name], ["y"], name="/down_proj/MatMul")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w1, w2])
    folder = tmp_path / "pkg"
    folder.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              str(folder / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data", size_threshold=0)
    return folder


@pytest.fixture(params=[True, False], ids=["bf16-reference", "fp32-reference"])
def reference(request, bf16, monkeypatch):
    """PyTorch's reference in the checkpoint's bfloat16 (a CPU with a bfloat16 multiply) and
    in float32 (one without), whatever this CPU has: each check holds with either."""
    import torch

    monkeypatch.setattr("onnxmedic.isa.computes_natively", lambda dtype: request.param)
    want = torch.bfloat16 if request.param else torch.float32
    assert stream_int4.reference_dtype(bf16[0]) == want
    return want


def test_the_reference_is_the_checkpoints_half_type_where_the_cpu_multiplies_it(
        bf16, tmp_path, monkeypatch):
    """A bfloat16 checkpoint: bfloat16 where the CPU has the multiply, else float32; a
    float32 checkpoint and one of mixed dtypes: float32 everywhere."""
    import torch
    from safetensors.torch import save_file

    asked = []
    monkeypatch.setattr("onnxmedic.isa.computes_natively",
                        lambda dtype: asked.append(dtype) or True)
    assert stream_int4.reference_dtype(bf16[0]) == torch.bfloat16 and asked == ["bfloat16"]
    monkeypatch.setattr("onnxmedic.isa.computes_natively", lambda dtype: False)
    assert stream_int4.reference_dtype(bf16[0]) == torch.float32
    monkeypatch.setattr("onnxmedic.isa.computes_natively", lambda dtype: True)
    for kinds in ((torch.float32,), (torch.bfloat16, torch.float32)):
        folder = tmp_path / str(len(kinds))
        folder.mkdir()
        save_file({f"w{i}": torch.zeros(2, dtype=k) for i, k in enumerate(kinds)},
                  str(folder / "model.safetensors"))
        assert stream_int4.reference_dtype(folder) == torch.float32


@pytest.mark.slow  # the builder's package, then generation in ONNX Runtime, PyTorch and genai
def test_the_streamed_int4_package_is_written_and_served(bf16, package, tmp_path, reference):
    folder, _model = bf16
    res = stream_int4.int4_streamed(package, folder, tmp_path / "out", budget=LOOSE)
    assert res.ok, [f.message for f in res.findings]
    said = json.dumps([f.to_dict() for f in res.findings], default=str)
    assert ".tmp-" not in said and res.path == str(tmp_path / "out"), said
    assert res.quantized == 2 * 5 + 1  # qkv, o, gate, up, down per layer, and the head
    assert res.tokens_genai == res.tokens_onnx
    assert res.figures["agreement"] >= 0.6 and res.figures["perplexity_ratio"] <= 1.05
    proto = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("MatMulNBits") == res.quantized and "MatMul" not in ops
    assert int4.rounding_problem(package / "model.onnx", tmp_path / "out" / "model.onnx") is None


def _sequential(folder, out, budget):
    """The figures of the road that ran one check after the other: ONNX Runtime decoding
    greedily on its own (a cache, step by step) and scoring the text in one child, then
    PyTorch's streamed passes along its tokens and over the text's windows."""
    from onnxmedic.genpackage import read_package
    from onnxmedic.hf.stream import checked_config

    budget = int4.parse_budget(budget)
    data = stream_int4.task_data(folder, budget.prompts, checked_config(folder).vocab_size)
    got = int4.score_onnx(out / "model.onnx", data, budget.steps, None,
                          layout=read_package(out))
    ref = {"tokens": stream_int4.torch_picks(folder, data.prompts, got["tokens"]),
           "perplexity": stream_int4.torch_perplexity(folder, data.text)}
    return got["tokens"], int4.judge(ref, {**got, "picks": got["tokens"]}, budget)


@pytest.mark.slow  # the builder's package, then both roads' generation and PyTorch passes
def test_the_overlapped_checks_give_the_sequential_roads_figures(bf16, package, tmp_path):
    """genai generating beside PyTorch's perplexity, ONNX Runtime scoring the text and
    confirming genai's tokens in one prefill per prompt beside PyTorch's pass along them: the
    same tokens, greedy agreement and perplexities as ONNX Runtime decoding on its own, then
    PyTorch."""
    folder, _model = bf16
    res = stream_int4.int4_streamed(package, folder, tmp_path / "out", budget=LOOSE)
    assert res.ok, [f.message for f in res.findings]
    assert {"genai+torch-windows", "onnx+torch-picks"} <= set(res.seconds)
    assert "torch-picks" not in res.seconds and res.decoded == []  # nothing done twice
    tokens, figures = _sequential(folder, tmp_path / "out", LOOSE)
    assert res.tokens_onnx == res.tokens_genai == tokens
    assert res.figures == figures
    # without genai: ONNX Runtime decodes on its own beside PyTorch's perplexity
    alone = stream_int4.int4_streamed(package, folder, tmp_path / "alone", budget=LOOSE,
                                      genai=False)
    assert alone.ok and alone.tokens_genai is None and alone.decoded == [0, 1]
    assert {"onnx+torch-windows", "torch-picks"} <= set(alone.seconds)
    assert alone.tokens_onnx == tokens and alone.figures == figures


def _genai_says(monkeypatch, edit):
    """onnxruntime-genai's tokens, as the road reads them from its child, passed through
    ``edit(tokens)``."""
    from onnxmedic.hf import gen_verify

    real = gen_verify.finish_genai_child

    def finish(*a, **k):
        out = real(*a, **k)
        if out is not None:
            out = {**out, "tokens": edit([list(t) for t in out["tokens"]])}
        return out

    monkeypatch.setattr(gen_verify, "finish_genai_child", finish)


@pytest.mark.slow  # the builder's package, generation in ONNX Runtime, PyTorch and genai
def test_genai_tokens_that_are_not_onnx_runtimes_are_refused(bf16, package, tmp_path,
                                                            monkeypatch):
    """genai's second prompt's fourth token changed: ONNX Runtime's prefill does not pick
    it, its step-by-step decode decides (its own tokens, judged by the budget along them),
    and genai's differ from them: OM736, nothing written."""
    folder, _model = bf16

    def edit(tokens):
        tokens[1][3] = (tokens[1][3] + 1) % 384
        return tokens

    _genai_says(monkeypatch, edit)
    res = stream_int4.int4_streamed(package, folder, tmp_path / "out", budget=LOOSE)
    assert not res.ok and not (tmp_path / "out").exists()
    assert [f.code for f in res.findings] == ["OM736"]
    assert "at step 3" in res.findings[0].message
    assert res.decoded == [1] and res.tokens_genai[1] != res.tokens_onnx[1]
    assert res.tokens_genai[0] == res.tokens_onnx[0]
    assert res.figures["agreement"] >= 0.6  # judged along ONNX Runtime's own tokens


@pytest.mark.slow  # the builder's package, generation in ONNX Runtime, PyTorch and genai
def test_a_prefill_pick_the_decode_does_not_make_is_no_disagreement(bf16, package, tmp_path,
                                                                   monkeypatch):
    """ONNX Runtime's prefill picks made to differ from genai's tokens (a near tie between
    the prefill's kernels and the decode's): the step-by-step decode decides, gives genai's
    tokens, and the package is written (no OM736), its figures the sequential road's."""
    folder, _model = bf16

    def in_process(path, data, steps, reference, *, layout=None, given=None, **_):
        """score_onnx in this process, with prefill picks one token off."""
        monkeypatch.setattr(int4, "prefill_picks",
                            lambda step, past0, prompt, tokens: [t + 1 for t in tokens])
        step = int4.ort_step(str(path), 1, layout)
        return {"ok": True, **int4.score(step, layout.empty_past(), data, steps, reference,
                                         given)}

    monkeypatch.setattr(int4, "score_onnx", in_process)
    seen = []
    _genai_says(monkeypatch, lambda t: seen.append(t) or t)
    res = stream_int4.int4_streamed(package, folder, tmp_path / "out", budget=LOOSE)
    assert res.ok, [f.message for f in res.findings]
    assert res.decoded == [0, 1] and seen and res.tokens_onnx == res.tokens_genai == seen[0]
    monkeypatch.undo()
    tokens, figures = _sequential(folder, tmp_path / "out", LOOSE)
    assert res.tokens_onnx == tokens and res.figures == figures


def test_onnx_runtimes_greedy_tokens_confirmed_or_decoded():
    """optimize/int4.greedy on a step function whose prefill and decode differ where told:
    given tokens equal to its prefill picks are its tokens, nothing decoded; given tokens it
    would not pick are replaced by its decode's; a prefill pick off where the decode agrees
    is decided by the decode (the given tokens kept, decoded)."""
    vocab, off = 16, set()

    def step(ids, past):
        """The next token is (the last + 3) % vocab; positions in ``off`` (of a prefill of
        several tokens) pick one more."""
        n = past[0].shape[0] + ids.shape[1]
        logits = np.zeros((1, ids.shape[1], vocab), np.float32)
        for i, t in enumerate(ids[0]):
            pos = n - ids.shape[1] + i
            logits[0, i, (int(t) + 3 + (ids.shape[1] > 1 and pos in off)) % vocab] = 1
        return logits, [np.zeros(n)]

    past0, prompt = [np.zeros(0)], [1, 2]
    want = int4.generate(step, past0, prompt, 4)
    assert want == [5, 8, 11, 14]
    assert int4.greedy(step, past0, prompt, 4, want) == (want, False)
    assert int4.greedy(step, past0, prompt, 4, [5, 8, 12, 15]) == (want, True)
    assert int4.greedy(step, past0, prompt, 4, want[:3]) == (want, True)  # genai stopped
    off.add(3)  # the prefill's pick after the second token is off, the decode's is not
    assert int4.prefill_picks(step, past0, prompt, want) != want
    assert int4.greedy(step, past0, prompt, 4, want) == (want, True)
    got = int4.score(step, past0, int4.TaskData([prompt, [3]], []), 4, given=[want, None])
    assert got["tokens"] == [want, int4.generate(step, past0, [3], 4)]
    assert got["decoded"] == [0, 1]


def test_the_quantization_is_the_quantizers_own(matmul_package, tmp_path):
    """One weight at a time, the same blocks and scales as ONNX Runtime's quantizer over the
    whole file (optimize/int4.py's RTN candidate at block 32, accuracy level 4)."""
    whole = tmp_path / "whole.onnx"
    int4.quantize_int4(str(matmul_package / "model.onnx"), str(whole), tied_embedding=False)
    assert stream_int4.quantize_streamed(matmul_package / "model.onnx",
                                         tmp_path / "streamed.onnx") == 2
    a = onnx.load(str(whole))
    b = onnx.load(str(tmp_path / "streamed.onnx"))
    qa = {t.name: onnx.numpy_helper.to_array(t) for t in a.graph.initializer if "_Q4" in t.name
          or t.name.endswith("_scales")}
    qb = {t.name: onnx.numpy_helper.to_array(t) for t in b.graph.initializer if "_Q4" in t.name
          or t.name.endswith("_scales")}
    assert qa.keys() == qb.keys() and qa
    for k in qa:
        np.testing.assert_array_equal(qa[k], qb[k])


@pytest.mark.parametrize("fault", ["block", "scale"])
def test_a_corrupted_block_or_a_wrong_scale_is_refused(bf16, matmul_package, tmp_path,
                                                      fault):
    """A 4-bit block of the last MLP weight rewritten, or one of its scales doubled: OM870,
    nothing written (before any generation)."""
    folder, _model = bf16

    def tamper(path):
        if fault == "block":
            _edit(path, lambda n: "down_proj" in n and n.endswith("_Q4"),
                  lambda q: np.where(np.arange(q.size).reshape(q.shape) < q.shape[-1], 0x88 ^ q,
                                     q).astype(q.dtype))
        else:
            _edit(path, lambda n: "down_proj" in n and n.endswith("_scales"),
                  lambda s: (s * np.where(np.arange(s.size) == 3, 2, 1).reshape(s.shape)
                             ).astype(s.dtype))

    res = stream_int4.int4_streamed(matmul_package, folder, tmp_path / "out", budget=LOOSE,
                                    tamper=tamper)
    assert not res.ok and not (tmp_path / "out").exists()
    assert [f.code for f in res.findings] == ["OM870"]
    assert "down_proj" in res.findings[0].message
    assert set(res.seconds) == {"quantize", "rounding"}  # refused before the task was run


@pytest.mark.slow  # the builder's package, ONNX Runtime's generation and PyTorch's pass
def test_a_wrong_float32_weight_beside_the_int4_ones_is_outside_the_budget(bf16, package,
                                                                         tmp_path, reference):
    """The final norm's weight (left float32, so no rounding rule sees it) negated: the task
    budget refuses the package (OM871), its figures in the finding."""
    folder, _model = bf16
    res = stream_int4.int4_streamed(
        package, folder, tmp_path / "out", budget=LOOSE,
        tamper=lambda p: _edit(p, lambda n: "final_norm" in n, lambda w: -w))
    assert not res.ok and not (tmp_path / "out").exists()
    assert [f.code for f in res.findings] == ["OM871"]
    assert res.figures["agreement"] < 0.6 or res.figures["perplexity_ratio"] > 1.05


def test_the_command_refuses_a_folder_it_cannot_stream(tmp_path, capsys):
    """``python -m onnxmedic.hf.transforms.stream_int4`` on folders that are no checkpoint:
    exit 1 and the reason, no traceback."""
    assert stream_int4.main([str(tmp_path / "pkg"), str(tmp_path), "-o",
                             str(tmp_path / "out")]) == 1
    assert "onnxmedic.hf.transforms.stream_int4:" in capsys.readouterr().err


@pytest.mark.slow  # the builder, generation in ONNX Runtime, PyTorch and genai
def test_export_int4_at_size_streams_without_loading_the_model(bf16, package, tmp_path,
                                                              monkeypatch):
    """``export_pretrained(FOLDER, precision="int4")`` on a checkpoint at least STREAM_FROM
    large: the builder's package made int4 and judged streamed, the PyTorch model never
    loaded (load_for_task would raise)."""
    import onnxmedic
    from onnxmedic import hf

    folder, _model = bf16  # its tokenizer copied in by the package fixture
    monkeypatch.setattr(stream_int4, "STREAM_FROM", 0)

    def no_load(*a, **k):
        raise AssertionError("the whole-model road loaded the model")

    monkeypatch.setattr(hf, "load_for_task", no_load)
    res = onnxmedic.export_pretrained(folder, tmp_path / "out", precision="int4",
                                      accuracy=LOOSE, report=tmp_path / "r.json")
    assert res.ok, [f.message for f in res.findings]
    assert res.stages == {"export": "passed", "optimize": "passed"}
    assert any(f.code == "OM819" and "judged streamed" in f.message for f in res.findings)
    # the writer's road (int4_writer), no float32 package, with PyTorch's perplexity beside
    assert "int4 write+torch-windows" in res.timings
    assert {"int4 write+torch-windows cpu", "int4 genai cpu", "int4 onnx+torch-picks cpu",
            "int4 write own cpu", "int4 genai own cpu", "int4 torch-windows own cpu"} <= set(
        res.timings)  # CPU seconds beside the wall seconds, each side's own too
    assert (tmp_path / "out" / "genai_config.json").is_file()
    assert (tmp_path / "out" / "config.json").is_file()
    assert ".tmp-" not in (tmp_path / "r.json").read_text()  # OUT named, not its scratch


def test_export_int4_below_the_size_keeps_the_whole_model_road(bf16, monkeypatch):
    folder, _model = bf16
    assert stream_int4.streamed_road(folder, None, dtype="fp32", verify=True, opset=None,
                                     backend="auto", remote_code=False) is None
    monkeypatch.setattr(stream_int4, "STREAM_FROM", 0)
    assert stream_int4.streamed_road(f"hf:{folder}", None, dtype="fp32", verify=True,
                                     opset=None, backend="auto", remote_code=False) == folder
    assert stream_int4.streamed_road(folder, None, dtype="fp32", verify=True, opset=None,
                                     backend="export", remote_code=False) is None


@pytest.mark.parametrize("view", [False, True], ids=["k-n", "n-k-transposed"])
@pytest.mark.parametrize("k", [64, 40])  # 40: the last block padded
def test_the_rounding_rule_of_one_weight(k, view):
    """optimize/int4.block_problem on ONNX Runtime's own blocks of a (k, 24) weight: none is
    off; one 4-bit level moved by two steps, or a scale halved, is found where it is; the
    same given the weight as the transposed view of an (N, K) array (the int4 writer's)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    w = np.random.default_rng(0).standard_normal((k, 24)).astype(np.float32)
    q, scales, _zp = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=32, is_symmetric=True, bits=4)).qbits_block_quant(w)
    at = {"N": 24, "K": k, "bits": 4, "block_size": 32}
    if view:
        w = np.ascontiguousarray(w.T).T
    assert int4.block_problem("m", w, q, scales, at) is None
    bad = q.copy()
    bad[5, 0, 3] = (bad[5, 0, 3] & 0xF0) | ((bad[5, 0, 3] & 15) ^ 2)  # weight (6, 5): 2 steps
    assert "weight (6, 5)" in int4.block_problem("m", w, bad, scales, at)
    half = scales.copy()
    half[7, 1 if k > 32 else 0] /= 2
    assert "m: weight (" in int4.block_problem("m", w, q, half, at)
