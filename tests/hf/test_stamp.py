"""The stamped road (onnxmedic.hf.stamp): a GPT-NeoX package made from one exported and verified
decoder layer, stamped per layer with the checkpoint's weights streamed into its external data,
computes what transformers' model computes (prefill and a decode step with a padded past); a
package whose layers were stamped with the wrong weights is refused by the streamed
verification; the road is taken only for a family the builder does not serve, at size."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from onnxmedic.hf import stamp, stream  # noqa: E402
from tests.hf import checkpoints  # noqa: E402

PROMPT = [[5, 9, 11, 40, 3, 17, 8], [7, 8, 21, 30, 31, 60, 2]]


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """A tiny GPT-NeoX checkpoint saved in bfloat16 (partial rotary, parallel residual, three
    layers) with a BPE tokenizer, the model loaded from it in float32, and its stamped
    package (not yet verified)."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    root = tmp_path_factory.mktemp("stamp")
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=64, rotary_pct=0.25,
                        max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # biases and norms away from transformers' zeros and ones: a
        for p in model.parameters():  # weight stamped in the wrong place shows
            p.add_(torch.randn_like(p) * 0.05)
    model.to(torch.bfloat16).save_pretrained(root / "ckpt")
    checkpoints.tokenizer("bpe").save_pretrained(root / "ckpt")
    made = stamp.stamp_package(root / "ckpt", root / "pkg", timeout=120)
    assert made.ok, [f.message for f in made.findings]
    return root, AutoModelForCausalLM.from_pretrained(root / "ckpt",
                                                      dtype=torch.float32).eval()


def _run(pkg: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_streamed_logits_of_gpt_neox_equal_the_whole_model(neox):
    """hf/stream.py's GPT-NeoX layout (embed_in, layers, final_layer_norm, embed_out): the
    streamed float32 logits are the whole model's within float32 rounding."""
    root, model = neox
    out = stream.streamed_logits(root / "ckpt", PROMPT)
    for i, seq in enumerate(PROMPT):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([seq]), use_cache=False).logits.numpy()
        got = out[torch.float32][i]
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 64 * np.finfo(np.float32).eps * np.abs(want).max()


def test_the_stamped_package_computes_the_model(neox):
    """Prefill (batch 2, the second prompt left-padded) then one decode step on its present:
    logits and cache within float32 rounding of transformers' own forward with its cache."""
    from transformers import DynamicCache

    root, model = neox
    pkg = root / "pkg"
    proto = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    names = {t.name for t in proto.graph.initializer}
    assert "gpt_neox.layers.2.mlp.dense_4h_to_h.weight" in names  # the checkpoint's names
    ids = np.array(PROMPT, dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    layers, heads, size = 3, 4, 8
    empty = np.zeros((2, heads, 0, size), np.float32)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
             **{f"past_key_values.{i}.{k}": empty for i in range(layers)
                for k in ("key", "value")}}
    got = _run(pkg, feeds)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos), use_cache=True)
    tol = 64 * np.finfo(np.float32).eps
    rows = mask.astype(bool)  # padded positions (queries that see no key) are not compared
    w = want.logits.numpy()
    assert np.abs(got[0][rows] - w[rows]).max() <= tol * np.abs(w).max()
    cache = want.past_key_values
    for i in range(layers):  # the padded positions' keys are never attended: not compared
        k = cache.layers[i].keys.numpy().transpose(0, 2, 1, 3)[rows]
        assert np.abs(got[1 + 2 * i].transpose(0, 2, 1, 3)[rows] - k).max() <= \
            tol * np.abs(k).max()
    step = np.array([[33], [44]], dtype=np.int64)
    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
    feeds2 = {"input_ids": step, "attention_mask": mask2, "position_ids": pos[:, -1:] + 1,
              **{f"past_key_values.{i}.{k}": got[1 + 2 * i + j] for i in range(layers)
                 for j, k in enumerate(("key", "value"))}}
    got2 = _run(pkg, feeds2)
    past = DynamicCache([(cache.layers[i].keys, cache.layers[i].values) for i in range(layers)])
    with torch.no_grad():
        want2 = model(input_ids=torch.tensor(step), attention_mask=torch.tensor(mask2),
                      position_ids=torch.tensor(pos[:, -1:] + 1), past_key_values=past,
                      use_cache=True).logits.numpy()
    assert np.abs(got2[0] - want2).max() <= tol * np.abs(want2).max()


def _swapped(pkg: Path, dst: Path, a: int, b: int) -> Path:
    """A copy of the package whose layers ``a`` and ``b`` hold each other's weights (their
    initializers' data swapped): a wrong stamp."""
    shutil.copytree(pkg, dst)
    proto = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    for name, t in inits.items():
        if name.startswith(f"gpt_neox.layers.{a}."):
            other = inits[name.replace(f"layers.{a}.", f"layers.{b}.", 1)]
            ea, eb = list(t.external_data), list(other.external_data)
            del t.external_data[:], other.external_data[:]
            t.external_data.extend(eb)
            other.external_data.extend(ea)
    onnx.save_model(proto, str(dst / "model.onnx"))
    return dst


def test_the_stamped_package_verifies_and_a_wrong_stamp_is_refused(neox):
    """The streamed verification passes the package (greedy tokens and each step's logits,
    onnxruntime-genai's tokens) and refuses it with two layers' weights swapped (OM811)."""
    root, _ = neox
    prompts = [PROMPT[0]]
    check = stream.verify_package(root / "pkg", root / "ckpt", prompts, steps=4)
    assert check.ok, [f.message for f in check.findings]
    assert check.tokens_genai == check.tokens_onnx
    bad = _swapped(root / "pkg", root / "swapped", 0, 1)
    check = stream.verify_package(bad, root / "ckpt", prompts, steps=4, genai=False)
    assert not check.ok
    assert "OM811" in {f.code for f in check.findings}


def test_the_road_is_taken_for_a_family_the_builder_does_not_serve_at_size(neox, bf16,
                                                                           monkeypatch):
    """stamp_road: GPT-NeoX at size (the threshold lowered here) from a folder; not under
    the threshold, not the builder's families (Llama: its streamed road), not with
    --backend builder, --optimize or an opset."""
    from onnxmedic.hf.transforms import stream_int4

    root, _ = neox
    ckpt = str(root / "ckpt")
    kw = dict(dtype="fp32", verify=True, opset=None, backend="auto", remote_code=False,
              options={})
    assert stamp.stamp_road(f"hf:{ckpt}", None, **kw) is None  # a tiny checkpoint
    monkeypatch.setattr(stream_int4, "STREAM_FROM", 0)
    assert stamp.stamp_road(f"hf:{ckpt}", None, **kw) == root / "ckpt"
    assert stamp.stamp_road(ckpt, None, **dict(kw, options={"precision": "int4"})) is not None
    assert stamp.stamp_road(str(bf16[0]), None, **kw) is None
    bare = root / "no-tokenizer"  # the whole-model road says OM806
    shutil.copytree(root / "ckpt", bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert stamp.stamp_road(str(bare), None, **kw) is None
    for change in ({"backend": "builder"}, {"options": {"optimize": True}}, {"opset": 18}):
        assert stamp.stamp_road(ckpt, None, **dict(kw, **change)) is None
    with pytest.raises(ValueError, match="not stamped"):
        stamp.stamp_package(bf16[0], root / "llama-pkg")


def test_a_part_that_does_not_export_is_said_and_nothing_written(neox, tmp_path,
                                                                 monkeypatch):
    """A part whose PyTorch code raises (the prelude here): OM850 after the export's own
    findings, OM818, no folder; the layers are not stamped."""
    root, _ = neox

    def broken(self, *args):
        raise RuntimeError("a prelude that does not run")

    monkeypatch.setattr(stamp.Prelude, "forward", broken)
    res = stamp.export_stamped(root / "ckpt", tmp_path / "out", timeout=60)
    codes = [f.code for f in res.findings]
    assert not res.ok and "OM850" in codes and "OM818" in codes and "OM851" not in codes
    assert res.stages["export"] == "failed"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_takes_the_stamped_road_and_refuses_a_wrong_stamp(neox, tmp_path,
                                                                 monkeypatch):
    """export_pretrained on the folder (at size: the threshold lowered) writes the stamped
    package, verified (OM851, OM819); export_stamped with two layers stamped swapped writes
    nothing (OM811 or OM812, OM818)."""
    from onnxmedic.hf import export_pretrained
    from onnxmedic.hf.transforms import stream_int4

    root, _ = neox
    monkeypatch.setattr(stream_int4, "STREAM_FROM", 0)
    res = export_pretrained(f"hf:{root / 'ckpt'}", tmp_path / "out",
                            task="text-generation-with-past", timeout=120)
    codes = {f.code for f in res.findings}
    assert res.ok and {"OM851", "OM819"} <= codes, [f.message for f in res.findings]
    assert (tmp_path / "out" / "genai_config.json").is_file()
    # at int4: the stamped float32 package quantized and judged streamed, OM819 saying so as
    # the streamed int4 road's does (its figures and PyTorch's reference dtype)
    four = stamp.export_stamped(root / "ckpt", tmp_path / "int4", precision="int4",
                                budget="agreement=1%", timeout=120)
    said = [f.message for f in four.findings if f.code == "OM819"]
    assert four.ok and four.path == str(tmp_path / "int4"), [f.message for f in four.findings]
    assert said and "judged streamed" in said[0] and four.int4.reference in said[0], said
    bad = stamp.export_stamped(root / "ckpt", tmp_path / "bad", order=[1, 0, 2], timeout=120)
    codes = {f.code for f in bad.findings}  # a token or a step's logits refused
    assert not bad.ok and "OM818" in codes and codes & {"OM811", "OM812"}
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_the_stamped_package_equals_the_traced_one(neox, tmp_path):
    """The same checkpoint's package by onnxmedic's own export (the whole model traced): the
    stamped one's logits and cache are the traced one's within float32 rounding, prefill and
    a decode step."""
    from onnxmedic.hf import export_generation

    root, model = neox
    traced = export_generation(model, tmp_path / "traced", verify=False, timeout=120)
    assert (tmp_path / "traced" / "model.onnx").is_file(), [f.message for f in traced.findings]
    ids = np.array(PROMPT, dtype=np.int64)
    mask = np.ones_like(ids)
    pos = np.cumsum(mask, 1) - 1
    empty = np.zeros((2, 4, 0, 8), np.float32)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
             **{f"past_key_values.{i}.{k}": empty for i in range(3)
                for k in ("key", "value")}}
    tol = 64 * np.finfo(np.float32).eps
    a, b = _run(root / "pkg", feeds), _run(tmp_path / "traced", feeds)
    for x, y in zip(a, b):
        assert np.abs(x - y).max() <= tol * np.abs(y).max()
    feeds = {"input_ids": np.array([[33], [44]], np.int64),
             "attention_mask": np.ones((2, 8), np.int64), "position_ids": pos[:, -1:] + 1,
             **{f"past_key_values.{i}.{k}": b[1 + 2 * i + j] for i in range(3)
                for j, k in enumerate(("key", "value"))}}
    x, y = _run(root / "pkg", feeds)[0], _run(tmp_path / "traced", feeds)[0]
    assert np.abs(x - y).max() <= tol * np.abs(y).max()


def test_the_geometry_is_the_package_contracts_and_read_once(neox, tmp_path, monkeypatch):
    """stamp_package reads the checkpoint's config once and takes the cache's sizes from the
    package contract's reader (genpackage.cache_sizes), the same for the exported layer and
    the assembled graph: GPT-NeoX's hidden / heads, a GQA config's key/value heads and
    head_dim; a config whose keys and values differ in size (MLA) is refused."""
    from transformers import AutoConfig, GPTNeoXConfig, LlamaConfig

    from onnxmedic.genpackage import cache_sizes

    neo = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=3,
                        vocab_size=128)
    assert stamp.geometry(neo) == stamp.Geometry(3, 4, 8, 128)
    gqa = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=2, vocab_size=100)
    assert stamp.geometry(gqa) == stamp.Geometry(2, 2, 16, 100)
    assert cache_sizes(gqa.to_dict()) == {"key": (2, 16), "value": (2, 16)}
    mla = AutoConfig.for_model("deepseek_v3", num_attention_heads=4, num_key_value_heads=4,
                               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match="no one"):
        stamp.geometry(mla)

    root, _ = neox
    reads, seen = [], []
    real = AutoConfig.from_pretrained

    def counted(*args, **kwargs):
        reads.append(args[0])
        return real(*args, **kwargs)

    def parts(folder, config, work, timeout, shape):
        seen.append(shape)
        return stamp.Stamped()  # stop after the parts

    monkeypatch.setattr(AutoConfig, "from_pretrained", counted)
    monkeypatch.setattr(stamp, "export_parts", parts)
    assert not stamp.stamp_package(root / "ckpt", tmp_path / "pkg").ok
    assert len(reads) == 1 and seen == [stamp.Geometry(3, 4, 8, 128)]
