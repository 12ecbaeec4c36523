"""int4 of a generation package whose cache holds states (convolution, state-space): the
builder's LFM2 package, the one such package onnxruntime-genai 0.18 serves (its builder
builds Lfm2ForCausalLM; our export's state packages take one token per step and have no
genai_config.json, OM829, so the transforms refuse them, OM741). The task budget's PyTorch
reference (int4_package.PackageReference) feeds the package's cache as its contract says,
the convolution state included (its step is the package's own), and a corrupted 4-bit block
of the convolution layer is not a rounding of the float32 weights: nothing is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")

from onnxmedic.hf import builder  # noqa: E402
from onnxmedic.optimize import int4_search  # noqa: E402

pytestmark = pytest.mark.slow  # the builder's package (~25 s of CPU), then int4 candidates


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """The zoo's tiny LFM2 checkpoint (a convolution layer, an attention layer), its model and
    tokenizer, and the builder's float32 package of it (``export --backend builder``)."""
    if not builder.available() or "Lfm2ForCausalLM" not in builder.served():
        pytest.skip("onnxruntime-genai's model builder with LFM2 not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onnxmedic.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.zoo.generation import save_family

    root = tmp_path_factory.mktemp("int4-states")
    folder = save_family("lfm2", root / "ckpt")
    pkg = root / "pkg"
    assert main(["export", f"hf:{folder}", "--task", "text-generation-with-past", "--backend",
                 "builder", "--no-progress", "-o", str(pkg)]) == 0
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, AutoTokenizer.from_pretrained(folder), pkg


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def _tampered(monkeypatch, edit) -> list[str]:
    """Every int4 candidate edited by ``edit(model)`` right after the quantizer wrote it
    (before its checks); returns the candidates' paths."""
    real, seen = int4_search.run_pipeline, []

    def run(pipeline, src, dst, **kw):
        out = real(pipeline, src, dst, **kw)
        model = onnx.load(str(dst))
        edit(model)
        onnx.save(model, str(dst))
        seen.append(str(dst))
        return out

    monkeypatch.setattr(int4_search, "run_pipeline", run)
    return seen


def test_state_package_int4_within_the_default_budget_served_by_genai(lfm2, tmp_path):
    """The builder's LFM2 package at int4 under the default budget: the reference and the
    candidates fed the package's keys, values and convolution state; MatMulNBits in the
    written decoder, the package's configs kept, onnxruntime-genai's tokens ONNX Runtime's."""
    from onnxmedic.genpackage import read_package
    from onnxmedic.hf.transforms.int4_package import int4_package

    model, tok, pkg = lfm2
    assert [c.kind for c in read_package(pkg).states] == ["conv"]
    r = int4_package(pkg, tmp_path / "int4", model, tok, grid=[(32, 4, "int4")], search=False)
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert "OM732" in {f.code for f in r.findings}
    assert "MatMulNBits" in _ops(tmp_path / "int4" / "model.onnx")
    assert json.loads((tmp_path / "int4" / "genai_config.json").read_text()) == json.loads(
        (pkg / "genai_config.json").read_text())
    assert r.tokens_genai is not None and r.tokens_genai == r.tokens_onnx


def test_the_reference_is_the_packages_step_states_included(lfm2):
    """The reference and ONNX Runtime fed the same past (keys and values 5 long, the
    convolution state in the package's shape: the kernel - 1 inputs, narrower than
    transformers' own cache holds) and one token: the state each returns is the past's
    shifted by one (its carried inputs exactly) then the new token's input, and their logits
    and presents agree; the same step from a zero state (what a reference that does not
    carry it would compute) does not."""
    from onnxmedic.genpackage import read_package
    from onnxmedic.hf.transforms.int4_package import PackageReference
    from onnxmedic.optimize import int4

    model, _, pkg = lfm2
    layout = read_package(pkg)
    ref = int4.torch_step(PackageReference(model, layout))
    ort = int4.ort_step(str(pkg / "model.onnx"), 1, layout)
    past = layout.past_of(5, seed=0)
    k = next(i for i, c in enumerate(layout.self_cache) if c.state)
    ids = np.asarray([[7]], np.int64)
    (lr, pr), (lo, po) = ref(ids, past), ort(ids, past)
    for present in (pr[k], po[k]):
        np.testing.assert_array_equal(present[..., :-1], past[k][..., 1:])
    np.testing.assert_allclose(pr[k], po[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lr, lo, rtol=1e-4, atol=1e-5)
    zero = [np.zeros_like(p) if i == k else p for i, p in enumerate(past)]
    assert np.abs(ref(ids, zero)[0] - lo).max() > 100 * np.abs(lr - lo).max()


@pytest.mark.parametrize("fault", ["levels", "scale"])
def test_a_corrupted_block_of_the_convolution_layer_is_refused(lfm2, tmp_path, monkeypatch,
                                                               fault):
    """One 4-bit block of the convolution layer's input projection corrupted after the
    quantizer wrote it (``levels``: each level 8 steps off; ``scale``: its block's scale
    doubled): not a rounding of the float32 weight, refused before it is scored, even under
    a budget that takes any candidate; nothing written."""
    from onnxmedic.hf.transforms.int4_package import int4_package
    from onnxmedic.optimize.int4 import TaskBudget

    model, tok, pkg = lfm2

    def corrupt(m):
        node = next(n for n in m.graph.node if n.op_type == "MatMulNBits"
                    and "layers.0" in n.name and "in_proj" in n.name)
        init = next(i for i in m.graph.initializer
                    if i.name == node.input[1 if fault == "levels" else 2])
        t = onnx.numpy_helper.to_array(init).copy()
        if fault == "levels":
            t.reshape(-1)[:16] ^= 0x88
        else:
            t.reshape(-1)[0] *= 2
        init.CopyFrom(onnx.numpy_helper.from_array(t, init.name))

    _tampered(monkeypatch, corrupt)
    loose = TaskBudget(perplexity=100.0, agreement=0.01, steps=4, prompts=1)
    r = int4_package(pkg, tmp_path / "int4", model, tok, grid=[(32, 4, "int4")], search=False,
                     budget=loose)
    assert not r.ok and "OM731" in {f.code for f in r.findings}
    cand = next(c for c in r.search.candidates if c.name != "fp32")
    assert "not a rounding" in cand.rejected and "in_proj" in cand.rejected, cand.rejected
    assert not (tmp_path / "int4").exists()


def test_the_reference_takes_a_package_of_one_token_per_step(tmp_path):
    """Our export's Falcon-H1 package (keys and values, a convolution and a state-space
    state per layer, one token per step; no genai_config.json, OM829): the reference and
    int4's ONNX Runtime step both feed a prompt token by token as the contract says, and
    generate the same greedy tokens with the same states."""
    from transformers import AutoModelForCausalLM

    from onnxmedic.cli import main
    from onnxmedic.genpackage import read_package
    from onnxmedic.hf.transforms.int4_package import PackageReference
    from onnxmedic.optimize import int4

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.zoo.generation import save_family

    folder = save_family("falcon_h1", tmp_path / "ckpt")
    pkg = tmp_path / "pkg"
    assert main(["export", f"hf:{folder}", "--task", "text-generation-with-past", "--backend",
                 "export", "--no-progress", "-o", str(pkg)]) == 0
    layout = read_package(pkg)
    assert layout.step_tokens == 1 and {c.kind for c in layout.states} == {"conv", "recurrent"}
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ref = int4.torch_step(PackageReference(model, layout))
    ort = int4.ort_step(str(pkg / "model.onnx"), 1, layout)
    prompt = [5, 17, 33, 90, 4]
    (lr, pr), (lo, po) = (s(np.asarray([prompt]), layout.empty_past()) for s in (ref, ort))
    assert lr.shape == lo.shape == (1, len(prompt), model.config.vocab_size)
    assert [p.shape for p in pr] == [p.shape for p in po]
    np.testing.assert_allclose(lr, lo, rtol=1e-4, atol=1e-5)
    assert int4.generate(ref, layout.empty_past(), prompt, 6) == int4.generate(
        ort, layout.empty_past(), prompt, 6)
