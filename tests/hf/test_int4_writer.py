"""The int4 package written straight from the checkpoint (onnxruntime-genai's builder making the
graph, each weight read, quantized, written and checked as it is made:
onnxmedic.hf.transforms.int4_writer, driven by stream_int4.int4_written): the package is the
builder's own ``-p int4`` package byte for byte, onnxruntime-genai serves it, and a faulty
quantizer (a corrupted 4-bit block, a wrong scale) is refused (OM870), nothing written."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")

from onnxmedic.hf import builder  # noqa: E402
from onnxmedic.hf.transforms import int4_writer, stream_int4  # noqa: E402
from tests.hf.test_stream_int4 import _sequential  # noqa: E402

LOOSE = "agreement=60%,steps=8,prompts=2"  # as test_stream_int4.py: the tiny model's ties


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2 checkpoint in bfloat16 (tied embeddings, q/k/v biases: the shape of the
    Qwen2.5 checkpoints), with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.zoo.generation import save_family

    root = tmp_path_factory.mktemp("int4-writer")
    folder = root / "qwen"
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=160, vocab_size=384,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    for f in save_family("llama", root / "tok").glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    return folder


def _builder_int4(folder: Path, out: Path, cache: Path) -> None:
    """The builder's own ``-p int4 -e cpu`` run (``python -m onnxruntime_genai.models.builder``'s
    create_model), forked as the writer is."""
    from onnxruntime_genai.models import builder as genai_builder

    opts = genai_builder.parse_extra_options(str(folder), str(folder), str(out), "int4", "cpu",
                                             str(cache), [])
    genai_builder.create_model(str(folder), str(folder), str(out), "int4", "cpu", str(cache),
                               **opts)


def _initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t, str(path.parent))
            for t in onnx.load(str(path), load_external_data=False).graph.initializer}


@pytest.fixture(scope="module")
def reference(qwen, tmp_path_factory):
    """The builder's own ``-p int4`` package of the tiny Qwen2 checkpoint."""
    import onnxruntime_genai.models.builder  # noqa: F401 - imported once, for the children

    theirs = builder.start(qwen, tmp_path_factory.mktemp("int4-ref") / "ref",
                           work=_builder_int4)
    assert theirs.wait(300) is None, theirs.log_tail()
    yield theirs.out
    theirs.discard()


# (INLINE, SLICE, TILE): the writer's own sizes; every initializer written by it, in slices of
# 4 KiB, each weight's slice made float32 and transposed 5 output columns at a time (the last
# tile of a slice shorter)
@pytest.mark.parametrize("sizes", [None, (0, 4096, 5)], ids=["as-is", "all-sliced"])
def test_the_written_package_is_the_builders_int4_package(qwen, reference, tmp_path,
                                                         monkeypatch, sizes):
    """The writer's package against ``python -m onnxruntime_genai.models.builder -p int4``'s
    on the same folder: the same nodes, the same initializers byte for byte (the 4-bit
    blocks, their scales, the norms, biases and rotary caches it writes itself), the same
    genai_config.json; and onnxruntime-genai loads it."""
    import onnxruntime_genai as og

    if sizes is not None:
        monkeypatch.setattr(int4_writer, "INLINE", sizes[0])
        monkeypatch.setattr(int4_writer, "SLICE", sizes[1])
        monkeypatch.setattr(int4_writer, "TILE", sizes[2])
    ref = reference
    job = builder.start(qwen, tmp_path / "ours", work=int4_writer.build)
    try:
        assert job.wait(300) is None, job.log_tail()
        assert int4_writer.verdict(job.root) == {"quantized": 2 * 5 + 1}
        a = onnx.load(str(ref / "model.onnx"), load_external_data=False)
        b = onnx.load(str(job.out / "model.onnx"), load_external_data=False)
        nodes = lambda m: sorted((n.op_type, n.name, tuple(n.input), tuple(n.output),  # noqa: E731
                                  str(sorted((x.name, x.i) for x in n.attribute)))
                                 for n in m.graph.node)
        assert nodes(a) == nodes(b)
        if sizes is not None:  # none left in the graph file
            assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in b.graph.initializer)
        ia, ib = _initializers(ref / "model.onnx"), _initializers(job.out / "model.onnx")
        assert ia.keys() == ib.keys()
        for k in ia:
            assert ia[k].dtype == ib[k].dtype and ia[k].shape == ib[k].shape, k
            np.testing.assert_array_equal(ia[k], ib[k], err_msg=k)
        assert (ref / "genai_config.json").read_text() == \
            (job.out / "genai_config.json").read_text()
        og.Model(str(job.out))
    finally:
        job.discard()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_quantizers_input_is_the_float32_transpose(dtype, monkeypatch):
    """transposed, the quantizer's (K, cols) float32 input made from a slice's rows in the
    checkpoint's dtype a tile at a time (7 columns here: the last tile shorter), is torch's
    float32 upcast of the rows transposed, bit for bit."""
    import torch

    from onnxmedic._tensors import to_numpy

    monkeypatch.setattr(int4_writer, "TILE", 7)
    torch.manual_seed(0)
    rows = (torch.randn(40, 96) * 0.02).to(getattr(torch, dtype))
    rows[3, 5] = float("inf")
    out = np.full((96, 40), np.nan, np.float32)
    got = int4_writer.transposed(to_numpy(rows), out)
    assert got is out
    want = rows.to(torch.float32).t().contiguous().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_halves_of_a_slice_are_its_whole():
    """The writer's own steps on a slice's two halves (two threads): the quantizer's input
    is the whole slice's transpose bit for bit (an uneven split of 300 columns), and the
    rounding check finds a corrupted block or a wrong scale in either half, naming the
    weight's columns; a clean slice passes."""
    from concurrent.futures import ThreadPoolExecutor

    import ml_dtypes
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((300, 64)) * 0.02).astype(ml_dtypes.bfloat16)
    at = {"bits": 4, "block_size": 32, "K": 64, "N": 300}
    with ThreadPoolExecutor(1) as pool:
        wf = np.full((64, 300), np.nan, np.float32)
        said = int4_writer.halves(lambda a, b: int4_writer.transposed(rows[a:b], wf[:, a:b]),
                                  300, pool)
        assert said[0][1] == 0 and said[1][1] % int4_writer.TILE == 0 and \
            0 < said[1][1] < 300
        np.testing.assert_array_equal(wf, rows.astype(np.float32).T)
        quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
            block_size=32, is_symmetric=True, accuracy_level=4, bits=4))
        packed, scales, _ = quantizer.qbits_block_quant(wf)
        q = packed.reshape(300, 2, 16)
        s = scales.astype(np.float32).ravel()
        assert int4_writer.rounding_of("w_Q4", rows, q, s, at, pool, 1000) is None
        for col in (5, 290):
            bad = q.copy()
            bad[col, 1] ^= 0x77  # a corrupted block
            why = int4_writer.rounding_of("w_Q4", rows, bad, s, at, pool, 1000)
            half = 0 if col < said[1][1] else said[1][1]
            assert why is not None and why.endswith(f"(output columns from {1000 + half})")
            wrong = s.copy()
            wrong[col * 2] *= 3  # a wrong scale
            assert int4_writer.rounding_of("w_Q4", rows, q, wrong, at, pool) is not None


def test_the_weights_are_read_as_safetensors_reads_them(qwen):
    """hf/stream.py's reader (the writer's and the streamed verification's): plain reads of
    each tensor's bytes, the same tensors as safetensors' own loader."""
    from safetensors.torch import load_file

    from onnxmedic.hf.stream import Weights

    shards = Weights(qwen)
    want = {}
    for p in qwen.glob("*.safetensors"):
        want.update(load_file(str(p)))
    assert set(shards.index) == set(want)
    for k, v in want.items():
        got = shards.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape and bool((got == v).all()), k


@pytest.mark.parametrize("fault", ["block", "scale"])
def test_a_faulty_quantizer_is_refused(qwen, tmp_path, fault):
    """The quantizer's blocks of the last layer's down projection corrupted (one 4-bit level
    moved in each block of its first output column), or one of its scales doubled, before
    they are written: the read-back check refuses the package (OM870, the weight named),
    nothing written, no generation run."""

    def tamper(weight, blocks, scales):
        if "layers.1.mlp.down_proj" not in weight:
            return
        if fault == "block":
            blocks[0] ^= 0x08
        else:
            scales.reshape(-1)[3] *= 2

    res = stream_int4.int4_written(qwen, tmp_path / "out", budget=LOOSE, tamper=tamper)
    assert res is not None and not res.ok and not (tmp_path / "out").exists()
    assert [f.code for f in res.findings] == ["OM870"]
    assert "down_proj" in res.findings[0].message
    assert "the checkpoint's" in res.findings[0].message
    assert "onnx" not in res.seconds
    # the writer's wall and CPU seconds (the child's, reaped) beside PyTorch's perplexity
    # (its result dropped), nothing after them
    assert set(res.cpu) == set(res.seconds) == {"write+torch-windows"}
    assert res.parts["write"] > 0 and set(res.parts) == {"write", "torch-windows"}
    assert not list(tmp_path.iterdir())  # nothing left beside it either


def _watched(monkeypatch):
    """The writer's jobs that int4_written starts, kept to look at after it returned."""
    jobs = []
    real = builder.start

    def start(*a, **k):
        jobs.append(real(*a, **k))
        return jobs[-1]

    monkeypatch.setattr(builder, "start", start)
    return jobs


def test_a_writer_that_fails_while_pytorch_runs_leaves_nothing(qwen, tmp_path, monkeypatch):
    """The writer's child ending in an error while PyTorch's perplexity runs beside it (the
    pass waits for the child's end before it computes): the pass's result dropped, None (the
    float32 package's road), the child reaped and its folder gone, nothing written."""

    def broken(folder, out, cache, tamper=None):
        raise RuntimeError("a family the hooks do not know")

    monkeypatch.setattr(int4_writer, "build", broken)
    jobs = _watched(monkeypatch)
    real = stream_int4.torch_perplexity
    seen = []

    def perplexity(*a, **k):
        while jobs[0]._poll() is None:  # the writer has failed before the pass ends
            time.sleep(0.01)
        seen.append(jobs[0].code)
        return real(*a, **k)

    monkeypatch.setattr(stream_int4, "torch_perplexity", perplexity)
    assert stream_int4.int4_written(qwen, tmp_path / "out", budget=LOOSE) is None
    assert seen and seen[0] != 0  # it failed while PyTorch's pass ran
    assert not jobs[0].root.exists() and not list(tmp_path.iterdir())


def test_an_error_in_pytorchs_pass_stops_the_writer(qwen, tmp_path, monkeypatch):
    """PyTorch's perplexity raising while the writer's child runs: the child is killed and
    reaped and its folder removed before the error goes on, nothing written."""

    def slow(folder, out, cache, tamper=None):
        time.sleep(600)  # the writer still running when PyTorch's pass fails

    monkeypatch.setattr(int4_writer, "build", slow)
    jobs = _watched(monkeypatch)

    def perplexity(*a, **k):
        raise RuntimeError("PyTorch's pass failed")

    monkeypatch.setattr(stream_int4, "torch_perplexity", perplexity)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="PyTorch's pass failed"):
        stream_int4.int4_written(qwen, tmp_path / "out", budget=LOOSE)
    assert time.perf_counter() - t0 < 60  # not the writer's 600 s
    assert jobs[0].code is not None and jobs[0].code != 0  # killed, reaped
    with pytest.raises(ChildProcessError):
        os.waitpid(jobs[0].pid, os.WNOHANG)
    assert not jobs[0].root.exists() and not list(tmp_path.iterdir())


def test_a_writer_that_fails_hands_over_to_the_float32_road(qwen, tmp_path, monkeypatch):
    """The writer's child failing for another reason than a rounding: None (the caller takes
    the float32 package's road), nothing written."""

    def broken(folder, out, cache, tamper=None):
        raise RuntimeError("a family the hooks do not know")

    monkeypatch.setattr(int4_writer, "build", broken)
    assert stream_int4.int4_written(qwen, tmp_path / "out", budget=LOOSE) is None
    assert not list(tmp_path.iterdir())


def test_two_int4_sessions_side_by_side_only_where_they_fit(tmp_path, monkeypatch):
    """sessions_fit: this process, the scoring child's own and two sessions of the package's
    files x SESSION_FACTOR against PEAK_BOUND x the checkpoint's weights (sizes made up)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    with open(pkg / "model.onnx.data", "wb") as f:
        f.truncate(2**30)  # 1 GiB of package, sparse
    monkeypatch.setattr(stream_int4, "resident", lambda: 2**30 // 2)
    need = 2**30 // 2 + stream_int4.CHILD_BASE + 2 * stream_int4.SESSION_FACTOR * 2**30
    weights = {}
    monkeypatch.setattr(stream_int4, "weight_bytes", lambda folder: weights["n"])
    weights["n"] = int(need / stream_int4.PEAK_BOUND) + 1
    assert stream_int4.sessions_fit(pkg, tmp_path)
    weights["n"] = int(need / stream_int4.PEAK_BOUND) - 2**20
    assert not stream_int4.sessions_fit(pkg, tmp_path)


def test_this_process_resident_bytes_are_read():
    assert 2**20 < stream_int4.resident() < 2**40


@pytest.mark.slow  # the writer, then generation in ONNX Runtime, PyTorch and genai
@pytest.mark.parametrize("fit", [False, True], ids=["one-session", "two-sessions"])
def test_the_written_package_is_judged_and_served(qwen, tmp_path, monkeypatch, fit):
    """Whether ONNX Runtime scores the text beside genai (two int4 sessions fit) or after
    it, the same verdict and the figures of the checks run one after the other."""
    monkeypatch.setattr(stream_int4, "sessions_fit", lambda folder, checkpoint: fit)
    res = stream_int4.int4_written(qwen, tmp_path / "out", budget=LOOSE)
    assert res is not None and res.ok, [f.message for f in res.findings]
    assert res.quantized == 2 * 5 + 1
    assert res.tokens_genai == res.tokens_onnx
    assert res.figures["agreement"] >= 0.6 and res.figures["perplexity_ratio"] <= 1.05
    # PyTorch's perplexity beside the writer, genai alone or beside ONNX Runtime's scoring of
    # the text, ONNX Runtime (confirming genai's tokens) beside PyTorch's picks
    assert {"write+torch-windows", "genai+onnx-windows" if fit else "genai",
            "onnx+torch-picks"} == set(res.seconds) == set(res.cpu)
    assert res.decoded == []  # ONNX Runtime's prefill confirmed genai's tokens
    # the figures of the checks run one after the other, on the package written
    tokens, figures = _sequential(qwen, tmp_path / "out", LOOSE)
    assert res.tokens_onnx == tokens and res.figures == figures
    assert (tmp_path / "out" / "genai_config.json").is_file()


@pytest.mark.slow  # the writer, then genai beside ONNX Runtime's scoring of the text
def test_a_failed_scoring_beside_genai_writes_nothing(qwen, tmp_path, monkeypatch):
    """ONNX Runtime's scoring of the text beside genai failing (its child crashed): OM871
    with its reason, nothing written."""
    from onnxmedic.optimize import int4

    scored = int4.score_onnx

    def crashing(path, data, *args, **kw):
        """The text's scoring (no prompts) crashes; the confirmation runs."""
        if not data.prompts:
            return {"ok": False, "error": "scoring crashed (exit -9): killed"}
        return scored(path, data, *args, **kw)

    monkeypatch.setattr(stream_int4, "sessions_fit", lambda folder, checkpoint: True)
    monkeypatch.setattr(int4, "score_onnx", crashing)
    res = stream_int4.int4_written(qwen, tmp_path / "out", budget=LOOSE)
    assert res is not None and not res.ok
    assert [f.code for f in res.findings] == ["OM871"]
    assert "scoring crashed" in res.findings[0].message
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
