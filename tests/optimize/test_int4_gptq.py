"""--precision int4 --calibration TEXT (issue 40): GPTQ candidates (optimize/int4_gptq.py), the
perplexity on the held-out part of the user's text, the free-running figures (OM743, --accuracy
free=) and an unusable text (OM742).

GPTQ is checked three ways: with an identity Hessian it is ONNX Runtime's symmetric RTN bit
for bit (the packing and the scales are ONNX Runtime's); on the trained test decoder it lowers
every layer's output error on text it was not calibrated on; and the task budget rejects a
GPTQ file with a corrupted block of 4-bit weights or a wrong scale. The decoder and the task
fixtures are test_int4.py's (bench/accuracy/train_decoder.py's "test" preset)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxmedic.findings import OnnxMedicError
from onnxmedic.genpackage import read_step
from onnxmedic.optimize import int4, int4_gptq, int4_text
from onnxmedic.optimize.int4_search import Int4Candidate, Int4Result, optimize_int4
from tests.optimize import test_int4 as base
from tests.optimize.test_int8_isa import needs_qemu

decoder, task = base.decoder, base.task  # its fixtures: the trained test decoder
_edit, _o_proj = base._edit, base._o_proj

GPTQ = (32, 0, "fp32", "gptq")  # block 32, float32 compute, LM head float32


def _stdlib_text(chars: int = 40_000) -> str:
    """Text the decoder was not trained on: the last standard-library modules by name (it
    trains on the first ones)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[-6:]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)[:chars]


@pytest.fixture(scope="module")
def windows(decoder):
    """(calibration windows, held-out windows) of the stdlib text through the tokenizer."""
    step, _ = decoder
    cal, held = int4_gptq.split_text(step.tokenizer.encode(_stdlib_text()).ids)
    return cal[:12], [held[i:i + 128] for i in range(0, len(held) - 127, 128)][:6]


@pytest.fixture(scope="module")
def gptq_file(decoder, windows, tmp_path_factory):
    """A GPTQ int4 file of the trained decoder (block 32, float32 compute, head float32)."""
    import json

    tmp = tmp_path_factory.mktemp("gptq")
    (tmp / "cal.json").write_text(json.dumps({"windows": windows[0]}))
    out = tmp / "gptq.onnx"
    int4.quantize_int4(decoder[1], str(out), 32, 0, "fp32", algo="gptq",
                       calibration=str(tmp / "cal.json"))
    return out


def _matmul(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("k,n,block", [(64, 48, 32), (100, 24, 32), (96, 40, 64)])
def test_gptq_with_an_identity_hessian_is_onnx_runtimes_rtn_bit_for_bit(k, n, block):
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    w = np.random.default_rng(k).standard_normal((k, n)).astype(np.float32)
    q = MatMulNBitsQuantizer(_matmul(w), bits=4, block_size=block, is_symmetric=True,
                             algo_config=DefaultWeightOnlyQuantConfig(
                                 block_size=block, is_symmetric=True, bits=4))
    q.process()
    ort = {i.name: numpy_helper.to_array(i) for i in q.model.model.graph.initializer}
    mine_model = int4_gptq.gptq_model(_matmul(w), {}, block)
    mine = {i.name: numpy_helper.to_array(i) for i in mine_model.graph.initializer}
    assert set(mine) == set(ort) == {"W_Q4", "W_scales"}
    assert np.array_equal(mine["W_Q4"], ort["W_Q4"])  # K not a multiple of the block too
    assert np.array_equal(mine["W_scales"], ort["W_scales"].reshape(mine["W_scales"].shape))
    node, = mine_model.graph.node
    attrs = {a.name: a.i for a in node.attribute}
    assert (node.op_type, node.domain, attrs) == ("MatMulNBits", "com.microsoft",
                                                 {"K": k, "N": n, "bits": 4, "block_size": block})


def test_gptq_lowers_every_layers_output_error_on_text_it_was_not_calibrated_on(decoder,
                                                                                windows):
    model = onnx.load(decoder[1])
    layout = read_step(decoder[1])
    cal = int4_gptq.hessians(model, windows[0], layout)
    held = int4_gptq.hessians(model, windows[1], layout)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    layers = int4_gptq.quantizable_layers(model.graph)
    assert len(layers) == 15  # 2 x (q, k, v, o, gate, up, down) + the LM head
    for node in layers:
        w = weights[node.input[1]].astype(np.float64)
        err = []
        for h in (None, cal[node.input[0]]):  # RTN, GPTQ
            codes, scales = int4_gptq.gptq(w.astype(np.float32), h, 32)
            deq = ((codes - 8.0) * np.repeat(scales, 32, axis=1))[:, :w.shape[0]].T
            d = w - deq
            err.append(np.trace(d.T @ held[node.input[0]] @ d))  # output error on held text
        assert err[1] < 0.8 * err[0], (node.name, err)


def _judge92(path, task):
    # on this 0.1 M-parameter model GPTQ keeps 94.5 % of the greedy picks (RTN 97.7 %, with
    # a corrupted block 88 %): the faults are shown against a budget the clean file meets
    data, ref = task
    got = int4.score_onnx(path, data, 32, ref["tokens"])
    assert got["ok"], got
    return int4.judge(ref, got, int4.parse_budget("agreement=92%"))


def test_a_gptq_file_is_within_the_budget_and_its_faults_are_rejected(gptq_file, task,
                                                                      tmp_path):
    j = _judge92(gptq_file, task)
    assert j["rejected"] == "" and j["perplexity_ratio"] < 1.01, j

    def fill(a):  # one block (32 weights) of column 0 of layer 0's o_proj: every nibble 15
        a[0, 0, :] = 0xFF

    fill.pick = lambda m: _o_proj(m).input[1]
    j = _judge92(_edit(gptq_file, tmp_path / "block.onnx", fill), task)
    assert "greedy agreement" in j["rejected"] and j["agreement"] < 0.92, j

    def scale(a):  # one block's scale 16x too large
        a.reshape(-1)[0] *= 16

    scale.pick = lambda m: _o_proj(m).input[2]
    j = _judge92(_edit(gptq_file, tmp_path / "scale.onnx", scale), task)
    assert "perplexity" in j["rejected"] and j["perplexity_ratio"] > 1.05, j


def _score_on_haswell(path, task, tmp_path):
    """int4.score_child on ``path`` in ONNX Runtime under QEMU's Haswell (AVX2, no VNNI)."""
    import json
    import subprocess
    import sys

    from tests.optimize.test_int8_isa import QEMU, QEMU_CPU

    data, ref = task
    req, res = tmp_path / "req.json", tmp_path / "res.json"
    req.write_text(json.dumps({"path": str(path), "threads": 2, "prompts": data.prompts,
                               "text": data.text, "steps": 32, "reference": ref["tokens"]}))
    subprocess.run([QEMU, "-cpu", QEMU_CPU, sys.executable, "-c",
                    "import sys; from onnxmedic.optimize.int4 import score_child; "
                    "score_child(sys.argv[1], sys.argv[2])", str(req), str(res)],
                   check=True, capture_output=True, timeout=600)
    return json.loads(res.read_text())


@pytest.mark.slow
@needs_qemu
def test_the_gptq_figures_and_the_fault_are_the_same_on_an_avx2_cpu(gptq_file, task, tmp_path):
    """The fault test above has a margin of 3 picks of 128 (94.5 % against 92 %); on a CPU
    with AVX2 and no VNNI (QEMU's Haswell; CI may run on one) the clean file's and the
    corrupted block's picks and perplexities are this machine's, so the margin holds there
    (the nearest top-2 gap among the clean file's picks is ~0.005 in logits, far above what
    another float32 kernel's rounding moves)."""
    data, ref = task

    def fill(a):
        a[0, 0, :] = 0xFF

    fill.pick = lambda m: _o_proj(m).input[1]
    bad = _edit(gptq_file, tmp_path / "block.onnx", fill)
    for path in (gptq_file, bad):
        here = int4.score_onnx(path, data, 32, ref["tokens"])
        there = _score_on_haswell(path, task, tmp_path)
        assert there["ok"] and there["picks"] == here["picks"], path
        assert there["perplexity"] == pytest.approx(here["perplexity"], rel=1e-4)
    budget = int4.parse_budget("agreement=92%")
    assert int4.judge(ref, there, budget)["rejected"]  # the fault still caught there


def test_the_free_running_budget_and_om743():
    ref = {"perplexity": 10.0, "tokens": [[1, 2, 3, 4]]}
    got = {"perplexity": 10.1, "picks": [[1, 2, 3, 4]], "tokens": [[1, 9, 9, 9]]}
    assert int4.judge(ref, got, int4.DEFAULT_BUDGET)["rejected"] == ""  # reported only
    free = int4.parse_budget("free=95%")
    assert free.free == 0.95 and "generating on its own" in free.describe()
    j = int4.judge(ref, got, free)
    assert "generating on its own, 25.0 %" in j["rejected"] and "step [1]" in j["rejected"]
    with pytest.raises(ValueError, match="int4 budget"):
        int4.parse_budget("free=150%")
    c = Int4Candidate("int4-x", perplexity=10.1, perplexity_ratio=1.01, agreement=1.0,
                      free_agreement=0.25, first_divergence=[1], divergence_margins=[0.01])
    res = Int4Result(int4.DEFAULT_BUDGET, "text", 10.0, [c], chosen="int4-x", message="m",
                     median_margin=2.0)
    codes = [f.code for f in res.findings()]
    assert codes == ["OM732", "OM743"]
    msg = res.findings()[1].message
    assert "25.0 %" in msg and "step 1" in msg and "0.01" in msg and "median gap" in msg
    c.free_agreement = 1.0
    assert [f.code for f in res.findings()] == ["OM732"]


def test_reference_margins_are_the_top2_gaps_along_the_greedy_tokens():
    def step(ids, past):  # logits: token t+1 wins by t+1 over the runner-up
        t = int(ids[0, -1])
        lg = np.zeros((1, 1, 8), np.float32)
        lg[0, 0, (t + 1) % 8] = t + 1
        return lg, past

    m = int4_text.reference_margins(step, [], [[0]], [[1, 2, 3]])
    assert m == [[1.0, 2.0, 3.0]]
    assert int4_text.divergence_margins(m, [1]) == [2.0]
    assert int4_text.divergence_margins(m, [None]) == [None]


def test_an_unusable_calibration_text_is_om742(decoder, task, tmp_path):
    step, path = decoder
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    cases = [(short, step.tokenizer, "at least 256"), (binary, step.tokenizer, "UTF-8"),
             (tmp_path / "missing.txt", step.tokenizer, "cannot be read"),
             (short, None, "no tokenizer")]
    for text, tok, why in cases:
        with pytest.raises(OnnxMedicError) as e:
            int4_text.load_user_text(text, tok, tmp_path)
        assert e.value.finding.code == "OM742" and why in e.value.finding.message
        assert e.value.finding.exit_code == 1
    out = tmp_path / "q.onnx"
    with pytest.raises(OnnxMedicError) as e:  # before anything is built or written
        optimize_int4(path, step, out=out, tokenizer=step.tokenizer, data=task[0],
                      reference_scores=task[1], calibration=short)
    assert e.value.finding.code == "OM742" and not out.exists()


@pytest.mark.slow
def test_calibration_adds_gptq_candidates_and_a_perplexity_on_the_users_text(decoder, task,
                                                                               tmp_path):
    step, path = decoder
    text = tmp_path / "mine.txt"
    text.write_text(_stdlib_text())
    res = optimize_int4(path, step, out=tmp_path / "q.onnx", tokenizer=step.tokenizer,
                        data=task[0], reference_scores=task[1], calibration=text,
                        grid=[(32, 0, "fp32")], gptq_grid=[GPTQ])
    assert [c.name for c in res.candidates] == ["fp32", "int4-b32-a0-headfp32",
                                                "int4-b32-a0-headfp32-gptq"]
    assert "mine.txt" in res.user_text and res.user_reference_perplexity > 1
    for c in res.candidates:
        assert c.user_perplexity is not None and c.user_perplexity_ratio < 1.05, c
        assert len(c.divergence_margins) == 4
    gptq = res.candidates[2]
    assert gptq.algo == "gptq" and gptq.within and gptq.perplexity_ratio < 1.05
    assert res.ok and res.written and "on your text" in res.message


@pytest.mark.slow
def test_cli_int4_takes_a_calibration_text(decoder, tmp_path, capsys, monkeypatch):
    from onnxmedic.cli import main
    from onnxmedic.optimize import int4_search

    monkeypatch.setattr(int4_search, "DEFAULT_GRID", [(32, 0, "fp32")])
    monkeypatch.setattr(int4_search, "GPTQ_GRID", [GPTQ])
    _, path = decoder
    text = tmp_path / "mine.txt"
    text.write_text(_stdlib_text())
    spec = f"{Path(__file__).resolve().parents[2] / 'bench/accuracy/train_decoder.py'}:step_model"
    rc = main(["optimize", path, spec, "--precision", "int4", "--calibration", str(text),
               "-o", str(tmp_path / "q.onnx")])
    out = capsys.readouterr().out
    assert rc == 0 and "int4-b32-a0-headfp32-gptq" in out and "yours" in out
    assert "your text (--calibration): mine.txt" in out
    (tmp_path / "short.txt").write_text("x = 1\n")
    rc = main(["optimize", path, spec, "--precision", "int4", "--calibration",
               str(tmp_path / "short.txt")])
    assert rc == 1 and "OM742" in capsys.readouterr().err
