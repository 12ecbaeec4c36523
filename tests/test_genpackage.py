"""The generation package contract (onnxmedic/genpackage.py): names, sizes and step feeds read
back from packages whoever wrote them - ours (fixed head sizes), onnxruntime-genai's builder
(symbolic ``kv_cache_dim``: sizes from genai_config.json), optimum's layout (merged decoder with
``use_cache_branch``, sizes from config.json), an encoder-decoder's decoder, a flat decoder
step - each run in ONNX Runtime where it is a graph that runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxmedic import genpackage as gp

VOCAB, HEADS, SIZE = 11, 2, 4


def _cache_graph(path: Path, past: list[str], present: list[str], *, heads: int | str = HEADS,
                 size: int | str = SIZE, extra: tuple[str, ...] = ("attention_mask",),
                 cross: list[str] = ()) -> Path:
    """A decoder step that runs: each present is its past with the new tokens' rows (ones)
    appended; logits are zeros per new token. ``cross`` inputs are read, never grown."""
    nodes, outs = [], []
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])]
    for name in extra:
        elem = TensorProto.BOOL if name == gp.USE_CACHE_BRANCH else TensorProto.INT64
        ins.append(helper.make_tensor_value_info(
            name, elem, [1] if name == gp.USE_CACHE_BRANCH else ["batch", "total"]))
    # the new rows: ones of (batch, heads, seq, size), the shape of past with 1 for its length
    nodes += [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
              helper.make_node("Unsqueeze", ["ids_f", "axes13"], ["ids4"]),
              helper.make_node("Mul", ["ids4", "zero"], ["ids0"]),
              helper.make_node("Add", ["ids0", "one"], ["ones"])]
    inits = [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
             helper.make_tensor("axes13", TensorProto.INT64, [2], [1, 3]),
             helper.make_tensor("keep", TensorProto.INT64, [4], [1, 1, 0, 1]),
             helper.make_tensor("unit", TensorProto.INT64, [4], [0, 0, 1, 0]),
             helper.make_tensor("vocab", TensorProto.FLOAT, [1, VOCAB], [0.0] * VOCAB)]
    for p, q in zip(past, present):
        ins.append(helper.make_tensor_value_info(p, TensorProto.FLOAT,
                                                 ["batch", heads, "past", size]))
        nodes += [helper.make_node("Shape", [p], [f"{p}.s"]),
                  helper.make_node("Mul", [f"{p}.s", "keep"], [f"{p}.s0"]),
                  helper.make_node("Add", [f"{p}.s0", "unit"], [f"{p}.s1"]),
                  helper.make_node("Expand", ["ones", f"{p}.s1"], [f"{p}.rows"]),
                  helper.make_node("Concat", [p, f"{p}.rows"], [q], axis=2)]
        outs.append(helper.make_tensor_value_info(q, TensorProto.FLOAT,
                                                  ["batch", heads, "total", size]))
    for c in cross:
        ins.append(helper.make_tensor_value_info(c, TensorProto.FLOAT,
                                                 ["batch", heads, "enc", size]))
    nodes += [helper.make_node("Unsqueeze", ["ids_f", "axes2"], ["ids3"]),
              helper.make_node("Mul", ["ids3", "vocab"], ["logits"])]
    inits.append(helper.make_tensor("axes2", TensorProto.INT64, [1], [2]))
    outs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                 ["batch", "seq", VOCAB]))
    graph = helper.make_graph(nodes, "step", ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _run_steps(path: Path, layout: gp.StepLayout, n: int = 3, **kw) -> list[np.ndarray]:
    """Prefill of 2 tokens, then ``n - 1`` decode steps, each fed its own present back."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    past, ids = None, [3, 4]
    for _ in range(n):
        feed = layout.feed(ids, past, **kw)
        out = dict(zip(names, sess.run(None, feed)))
        past, ids = layout.presents(out), [int(np.argmax(layout.logits(out)[0, -1]))]
    return past


def test_names():
    assert gp.cache_names(2) == ["past_key_values.0.key", "past_key_values.0.value",
                                 "past_key_values.1.key", "past_key_values.1.value"]
    assert gp.cache_names(1, gp.SELF, present=True) == ["present.0.decoder.key",
                                                        "present.0.decoder.value"]
    assert gp.genai_pattern("value", gp.CROSS) == "past_key_values.%d.encoder.value"
    assert gp.present_of("past_key_values.3.encoder.key") == "present.3.encoder.key"
    assert gp.parse_cache_name("present.12.value") == ("present", 12, None, "value")
    assert gp.parse_cache_name("past_key_values.x.key") is None


def test_our_package_fixed_sizes(tmp_path):
    path = _cache_graph(tmp_path / "model.onnx", gp.cache_names(2), gp.cache_names(2, present=True),
                        extra=("attention_mask", "position_ids"))
    layout = gp.read_package(tmp_path)
    assert layout.named and layout.past == gp.cache_names(2) and not layout.sizes_from
    assert [p.shape for p in layout.empty_past()] == [(1, HEADS, 0, SIZE)] * 4
    feed = layout.feed([3, 4, 5], [np.zeros((1, HEADS, 2, SIZE), np.float32)] * 4)
    assert feed["attention_mask"].shape == (1, 5)
    assert feed["position_ids"].tolist() == [[2, 3, 4]]
    past = _run_steps(path, layout)
    assert [p.shape for p in past] == [(1, HEADS, 4, SIZE)] * 4


def test_builder_package_symbolic_head_size_from_genai_config(tmp_path):
    """The builder's cache: heads fixed, head size ``kv_cache_dim``: its genai_config.json says
    it; without a config the contract says why it cannot feed the first step."""
    path = _cache_graph(tmp_path / "model.onnx", gp.cache_names(2),
                        gp.cache_names(2, present=True), size="kv_cache_dim")
    with pytest.raises(gp.NotAStep, match="symbolic head count or head size"):
        gp.read_package(tmp_path).empty_past()
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {
        "context_length": 64, "decoder": {"num_key_value_heads": HEADS, "head_size": SIZE}}}))
    layout = gp.read_package(tmp_path)
    assert layout.sizes_from.endswith("genai_config.json") and layout.context == 64
    assert [p.shape for p in _run_steps(path, layout)] == [(1, HEADS, 4, SIZE)] * 4
    # a candidate written elsewhere (no configs beside it) reads the layout passed to it
    again = gp.StepLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout


def test_optimum_merged_decoder_sizes_from_config(tmp_path):
    path = _cache_graph(tmp_path / "decoder_model_merged.onnx", gp.cache_names(1),
                        gp.cache_names(1, present=True), heads="num_kv", size="head",
                        extra=("attention_mask", "position_ids", gp.USE_CACHE_BRANCH))
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": HEADS, "hidden_size": 4 * SIZE,
         "max_position_embeddings": 32}))
    layout = gp.read_package(tmp_path)
    assert gp.decoder_graph(tmp_path) == path and layout.context == 32
    assert layout.feed([3, 4])[gp.USE_CACHE_BRANCH].tolist() == [False]
    assert layout.feed([3], layout.empty_past())[gp.USE_CACHE_BRANCH].tolist() == [False]
    grown = [np.zeros((1, HEADS, 2, SIZE), np.float32)] * 2
    assert layout.feed([3], grown)[gp.USE_CACHE_BRANCH].tolist() == [True]
    assert [p.shape for p in _run_steps(path, layout)] == [(1, HEADS, 4, SIZE)] * 2


def test_mla_key_and_value_sizes_from_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 32,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}))
    sizes, source = gp.config_sizes(tmp_path)
    assert sizes == {"key": (2, 12), "value": (2, 6)} and source == "config.json"


def test_encoder_decoder_step_takes_the_cross_cache(tmp_path):
    selfs = gp.cache_names(1, gp.SELF)
    cross = gp.cache_names(1, gp.CROSS)
    path = _cache_graph(tmp_path / "decoder_with_past_model.onnx", selfs,
                        gp.cache_names(1, gp.SELF, present=True),
                        extra=(gp.ENCODER_ATTENTION_MASK,), cross=cross)
    layout = gp.read_step(path)
    assert [c.name for c in layout.self_cache] == selfs
    assert [c.name for c in layout.cross_cache] == cross
    enc = {gp.present_of(c): np.ones((1, HEADS, 5, SIZE), np.float32) for c in cross}
    with pytest.raises(gp.NotAStep, match="cross-attention"):
        layout.feed([3])
    mask = np.ones((1, 5), np.int64)
    assert [p.shape for p in _run_steps(path, layout, cross=enc, encoder_mask=mask)] == \
        [(1, HEADS, 4, SIZE)] * 2


def test_flat_decoder_step_by_position(tmp_path):
    path = _cache_graph(tmp_path / "step.onnx", ["k0", "v0"], ["pk0", "pv0"], extra=())
    layout = gp.read_step(path)
    assert not layout.named and [c.present for c in layout.cache] == ["pk0", "pv0"]
    assert list(layout.feed([3])) == ["input_ids", "k0", "v0"]
    assert [p.shape for p in _run_steps(path, layout)] == [(1, HEADS, 4, SIZE)] * 2
    relu = tmp_path / "relu.onnx"
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(g), str(relu))
    with pytest.raises(gp.NotAStep, match="not a decoder step"):
        gp.read_step(relu)


def test_optimize_says_why_it_cannot_feed_a_package_om839(tmp_path, capsys):
    """A builder-like package whose head size no config states: a finding, exit 1, nothing
    written, no traceback (the int4 road raised a ValueError here)."""
    from onnxmedic.cli import main

    pkg = tmp_path / "pkg"
    _cache_graph(pkg / "model.onnx", gp.cache_names(1), gp.cache_names(1, present=True),
                 size="kv_cache_dim")
    for precision in ("int4", "fp32"):
        rc = main(["optimize", str(pkg), f"hf:{tmp_path / 'ckpt'}", "--precision", precision,
                   "-o", str(tmp_path / "out")])
        out, err = capsys.readouterr()
        assert rc == 1 and "OM839" in out and "kv_cache_dim" not in err
        assert "Traceback" not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]


def test_the_api_road_refuses_what_the_command_refuses_before_any_work(tmp_path):
    """package_precision called directly runs the package's own checks (the command asks
    them before it loads the checkpoint and tells it so): OM839 for a decoder the contract
    cannot feed, OM741 for a package without genai_config.json; nothing written."""
    from onnxmedic.hf.transforms.precision import package_precision

    unfed, plain = tmp_path / "unfed", tmp_path / "plain"
    _cache_graph(unfed / "model.onnx", gp.cache_names(1), gp.cache_names(1, present=True),
                 size="kv_cache_dim")
    plain.mkdir()
    _cache_graph(plain / "model.onnx", gp.cache_names(1), gp.cache_names(1, present=True))
    for folder, code in ((unfed, "OM839"), (plain, "OM741")):
        for precision in ("int4", "fp32"):
            res = package_precision(folder, tmp_path / "out", None, precision=precision)
            assert not res.ok and [f.code for f in res.findings] == [code], res.findings
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "unfed"]


def test_state_names():
    """A layer's states take onnxruntime-genai's names (past.{i}.conv / .recurrent)."""
    assert gp.cache_name(2, "conv") == "past.2.conv"
    assert gp.cache_name(0, "recurrent", present=True) == "present.0.recurrent"
    assert gp.parse_cache_name("present.1.recurrent") == ("present", 1, None, "recurrent")
    assert gp.parse_cache_name("past.3.conv") == ("past_key_values", 3, None, "conv")
    assert gp.is_past("past.0.conv") and not gp.is_past("present.0.conv")
    assert not gp.is_past("past.0.key") and gp.parse_cache_name("past.0.key") is None
    assert gp.present_of("past.4.recurrent") == "present.4.recurrent"


def _state_graph(path: Path, channels: int = 3, width: int = 2, size: int | str = 1) -> Path:
    """A one-token step with a key/value layer and a convolution state: the key/value grows
    as in _cache_graph; ``present.0.conv`` is ``past.0.conv`` plus the token's id (a running
    sum, so a state that is not fed back shows); logits are the state's sum times a ramp."""
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["ids_f", "ax2"], ["ids3"]),
             helper.make_node("Add", ["past.0.conv", "ids3"], ["present.0.conv"]),
             helper.make_node("ReduceSum", ["present.0.conv", "ax12"], ["tot"], keepdims=1),
             helper.make_node("Mul", ["tot", "ramp"], ["logits"]),
             helper.make_node("Mul", ["ids3", "zero"], ["z3"]),
             helper.make_node("Unsqueeze", ["z3", "ax3"], ["z4"]),
             helper.make_node("Add", ["z4", "one"], ["row"]),
             helper.make_node("Concat", ["past_key_values.0.key", "row"],
                              ["present.0.key"], axis=2),
             helper.make_node("Concat", ["past_key_values.0.value", "row"],
                              ["present.0.value"], axis=2)]
    inits = [helper.make_tensor("ax2", TensorProto.INT64, [1], [2]),
             helper.make_tensor("ax3", TensorProto.INT64, [1], [3]),
             helper.make_tensor("ax12", TensorProto.INT64, [2], [1, 2]),
             helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
             helper.make_tensor("ramp", TensorProto.FLOAT, [1, 1, VOCAB],
                                [float(v % 5) for v in range(VOCAB)])]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 1]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "t"]),
           helper.make_tensor_value_info("past_key_values.0.key", f, ["batch", 1, "past", size]),
           helper.make_tensor_value_info("past_key_values.0.value", f,
                                         ["batch", 1, "past", size]),
           helper.make_tensor_value_info("past.0.conv", f, ["batch", channels, width])]
    outs = [helper.make_tensor_value_info("logits", f, ["batch", 1, VOCAB]),
            helper.make_tensor_value_info("present.0.key", f, ["batch", 1, "t", 1]),
            helper.make_tensor_value_info("present.0.value", f, ["batch", 1, "t", 1]),
            helper.make_tensor_value_info("present.0.conv", f, ["batch", channels, width])]
    model = helper.make_model(helper.make_graph(nodes, "step", ins, outs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_state_package_is_fed_one_token_at_a_time(tmp_path):
    """A graph of one token per step with a state: the contract reads the state's fixed
    shape, starts it at zeros, refuses a step of two tokens, and the own loop feeds a prompt
    token by token, the state carried from each token to the next (the prefill's logits are
    those of every prompt token)."""
    from onnxmedic.hf.gen_verify import GenerationCheck, onnx_generation

    path = _state_graph(tmp_path / "model.onnx")
    layout = gp.read_package(tmp_path)
    assert layout.step_tokens == 1 and [c.kind for c in layout.cache] == [
        "key", "value", "conv"]
    conv = layout.cache[2]
    assert conv.state and conv.shape == [3, 2] and conv.present == "present.0.conv"
    assert [p.shape for p in layout.empty_past()] == [(1, 1, 0, 1), (1, 1, 0, 1), (1, 3, 2)]
    with pytest.raises(gp.NotAStep, match="token by token"):
        layout.feed([3, 4])
    assert layout.feed([3], layout.empty_past(), past_length=5)["attention_mask"].shape == (1, 6)
    check = GenerationCheck()
    tokens, logits, _ = onnx_generation(path, layout, [2, 3, 1], 2, 60, check)
    assert check.ok and len(tokens) == 2
    # every prompt token's logits: the running sum of the ids so far (6 cells) times the ramp
    ramp = np.arange(VOCAB) % 5
    sums = [2, 5, 6]
    np.testing.assert_allclose(logits[0][0], [np.float32(6 * s) * ramp for s in sums])
    np.testing.assert_allclose(logits[1][0, 0], 6 * (6 + tokens[0]) * ramp)


def test_states_only_step_needs_the_past_length(tmp_path):
    """A cache of states only has no sequence axis: after the first step the mask's length
    must be said (the loop counts the tokens), else the contract says why it cannot feed."""
    path = _state_graph(tmp_path / "model.onnx")
    layout = gp.read_package(tmp_path)
    layout.cache = layout.cache[2:]  # as if the graph had only the state
    with pytest.raises(gp.NotAStep, match="past_length"):
        layout.feed([3], [np.zeros((1, 3, 2), np.float32)])
    assert layout.feed([3], [np.zeros((1, 3, 2), np.float32)],
                       past_length=4)["attention_mask"].shape == (1, 5)
    assert path.exists()


def test_builder_state_package_sizes_its_keys_not_its_states(tmp_path):
    """The builder's LFM2 package: key/value head size symbolic (its genai_config.json says
    it), convolution state fixed: the sizes are filled for the keys only (the states were read
    as a key's kind: KeyError 'conv', OM009 under --backend auto)."""
    _state_graph(tmp_path / "model.onnx", size="kv_cache_dim")
    (tmp_path / "genai_config.json").write_text(json.dumps(
        {"model": {"decoder": {"num_key_value_heads": 1, "head_size": 1}}}))
    layout = gp.read_package(tmp_path)
    assert layout.sizes_from.endswith("genai_config.json") and not layout.unsized()
    assert [p.shape for p in layout.empty_past()] == [(1, 1, 0, 1), (1, 1, 0, 1), (1, 3, 2)]


def test_a_package_the_transforms_cannot_take_is_said_before_any_work_om741(tmp_path, capsys):
    """optimize PACKAGE: a package without genai_config.json (every transform is judged by
    onnxruntime-genai) is OM741 before the checkpoint is read (it does not exist here), at
    int4 and fp32; nothing is written, no traceback. With the config the road goes on to the
    checkpoint (OM800: missing), a cache of states too (the builder's LFM2 package: its int4
    reference feeds the states; it was OM741 at int4, and an internal error, OM009, before)."""
    from onnxmedic.cli import main

    plain, states = tmp_path / "plain", tmp_path / "states"
    plain.mkdir()
    states.mkdir()
    _cache_graph(plain / "model.onnx", gp.cache_names(1), gp.cache_names(1, present=True))
    _state_graph(states / "model.onnx")
    (states / "genai_config.json").write_text('{"model": {"decoder": {}}}')

    def run(pkg: Path, precision: str) -> tuple[int, str]:
        rc = main(["optimize", str(pkg), f"hf:{tmp_path / 'ckpt'}", "--precision", precision,
                   "-o", str(tmp_path / "out")])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return rc, out + err

    for precision in ("int4", "fp32"):
        rc, said = run(plain, precision)
        assert rc == 1 and "OM741" in said and "genai_config.json" in said, said
        rc, said = run(states, precision)  # on to the checkpoint
        assert rc == 1 and "OM741" not in said and "OM800" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "states"]


def test_a_past_of_any_length_from_the_contract(tmp_path):
    """The past int4 times a decode step after (int4_search.decode_feeds): keys and values
    of the length asked, a state in its fixed shape (it was read as a key, (batch, heads,
    past, head_size): IndexError on the state's three dims); the graph runs on the feeds."""
    from onnxmedic.optimize.int4_search import decode_feeds

    path = _state_graph(tmp_path / "model.onnx")
    layout = gp.read_package(tmp_path)
    past = layout.past_of(7, seed=0)
    assert [p.shape for p in past] == [(1, 1, 7, 1), (1, 1, 7, 1), (1, 3, 2)]
    assert all(p.dtype == np.float32 and p.any() for p in past)
    assert not any(p.any() for p in layout.past_of(7))  # zeros without a seed
    feeds = decode_feeds(layout, past=7)
    assert feeds["attention_mask"].shape == (1, 8) and feeds["past.0.conv"].shape == (1, 3, 2)
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert out[0].shape == (1, 1, VOCAB)



def test_int4s_onnx_step_feeds_a_prompt_token_by_token(tmp_path):
    """int4's ONNX Runtime step (optimize/int4.ort_step) on a graph of one token per step:
    the prompt in one call is fed token by token (StepLayout.chunks), the state carried,
    the logits of every token returned (a prompt fed whole was refused: NotAStep, each
    candidate rejected); greedy generation and teacher-forced picks run on it."""
    from onnxmedic.optimize import int4

    path = _state_graph(tmp_path / "model.onnx")
    layout = gp.read_package(tmp_path)
    assert [c.tolist() for c in layout.chunks([2, 3, 1])] == [[[2]], [[3]], [[1]]]
    step = int4.ort_step(str(path), 1, layout)
    logits, past = step(np.asarray([[2, 3, 1]], np.int64), layout.empty_past())
    ramp = np.arange(VOCAB) % 5
    np.testing.assert_allclose(logits[0], [np.float32(6 * s) * ramp for s in (2, 5, 6)])
    assert [p.shape for p in past] == [(1, 1, 3, 1), (1, 1, 3, 1), (1, 3, 2)]
    tokens = int4.generate(step, layout.empty_past(), [2, 3, 1], 3)
    assert tokens == [4, 4, 4]  # the ramp's largest entry, whatever the sum
    assert int4.forced(step, layout.empty_past(), [2, 3, 1], tokens) == tokens
