"""Caches beyond keys, values and a layer's states: a sparse attention's indexer keys
(DeepSeek Sparse Attention: AXK2, HY-V4; transformers' ``DynamicIndexedLayer``) carried as
``past_key_values.{i}.indexer_key`` beside the layer's keys and values (were refused, OM827),
and what is still refused: an indexer's positions; MiniMax's own cache class's linear-attention
states, carried as ``past.{i}.recurrent``."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from onnxmedic import genpackage as gp
from onnxmedic.hf import generation

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.zoo import family_sweep  # noqa: E402


def _indexed_cache(positions: bool = False):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicIndexedLayer

    layer = DynamicIndexedLayer()
    layer.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
    layer.update_indexer(torch.ones(1, 2, 8))
    if positions:  # Qwen4-Exp's indexer keeps its keys' positions too
        layer.indexer_position_ids = torch.zeros(1, 1, 2, dtype=torch.int64)
    cache = DynamicCache()
    cache.layers = [layer]
    return cache


def _model_with(cache):
    class Indexed(torch.nn.Module):
        config = SimpleNamespace(vocab_size=10)

        def forward(self, **kw):
            return SimpleNamespace(past_key_values=cache)

    return Indexed()


def test_indexer_keys_are_carried_and_indexer_positions_refused():
    """Indexer keys are an entry of the cache (key, value, indexer_key per layer), fed back
    as the layer's own; an indexer's positions (no entry in the package) stay OM827."""
    cache = _indexed_cache()
    assert generation.cache_problem(_model_with(cache)) is None
    spec = generation.cache_spec(cache)
    assert spec == [(0, "key"), (0, "value"), (0, gp.INDEXER)]
    assert generation.own_layers(spec) and not generation.has_states(spec)
    flat = generation.flat_cache(cache, spec)
    assert [list(t.shape) for t in flat] == [[1, 2, 2, 16], [1, 2, 2, 16], [1, 2, 8]]
    assert generation.io_names(3, spec)[0] == [
        "past_key_values.0.key", "past_key_values.0.value", "past_key_values.0.indexer_key"]

    said = generation.cache_problem(_model_with(_indexed_cache(positions=True)))
    assert said is not None and said.code == "OM827", said
    assert "0 DynamicIndexedLayer: indexer_position_ids [1, 1, 2]" in said.message
    assert "--task text-generation" in said.suggestion


def _step_is_the_models_own(model) -> tuple[list, list]:
    """GenerationDecoder(model) on example_step's inputs (new tokens after the model's own
    cache of a past, fed back flat): its logits are the model's own on the whole sequence;
    returns the spec and the present."""
    args, _, spec = generation.example_step(model)
    ids, mask, pos, past = args
    step = generation.GenerationDecoder(model, True, spec).eval()
    with torch.no_grad():
        logits, present = step(ids, mask, pos, [t.clone() for t in past])
        g = torch.Generator().manual_seed(0)  # example_step's own past tokens
        probe = torch.randint(min(4, model.config.vocab_size - 1), model.config.vocab_size,
                              (ids.shape[0], generation.EXAMPLE_PAST), generator=g)
        whole = model(input_ids=torch.cat([probe, ids], 1)).logits
    torch.testing.assert_close(logits, whole[:, -ids.shape[1]:], rtol=1e-4, atol=1e-5)
    return spec, present


def test_the_step_with_indexer_keys_is_the_models_own():
    """HY-V4 (indexed attention in every layer, an indexer keeping 4 tokens: the sparse
    selection at work) as the graph's function (was a refusal; the plain DynamicCache raised
    in the model's update_indexer)."""
    model = family_sweep.tiny_model("hy_v4", "causal")
    assert model.config.index_topk == 4
    spec, present = _step_is_the_models_own(model)
    assert (0, gp.INDEXER) in spec and (1, gp.INDEXER) in spec
    total = generation.EXAMPLE_PAST + generation.EXAMPLE_NEW
    indexer = [t for t, (_, kind) in zip(present, spec) if kind == gp.INDEXER]
    assert [t.shape[1] for t in indexer] == [total, total]


@pytest.mark.parametrize("layers", [["linear_attention", "full_attention"],
                                    ["full_attention", "linear_attention"]])
def test_minimax_linear_attention_state_is_carried(layers):
    """MiniMax keeps its lightning (linear) attention's state in its own cache class's
    ``linear_cache``, not in a layer, and its forward takes no other cache (was OM828:
    "MiniMax uses cache of its own"): the state is the layer's ``recurrent`` entry, fed back
    in a MiniMaxCache; a linear layer's empty DynamicLayer is no reason to refuse."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "minimax", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, num_local_experts=4,
        num_experts_per_tok=2, layer_types=layers, vocab_size=384, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert generation.cache_problem(model) is None
    spec, _ = _step_is_the_models_own(model)
    linear = layers.index("linear_attention")
    assert (linear, "recurrent") in spec and generation.has_states(spec)
    assert (1 - linear, "key") in spec


def _indexed_step_graph(path: Path) -> Path:
    names = gp.cache_names(1) + [gp.cache_name(0, gp.INDEXER)]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(gp.INPUT_IDS, TensorProto.INT64, ["b", "s"]),
           helper.make_tensor_value_info(gp.ATTENTION_MASK, TensorProto.INT64, ["b", "t"])]
    ins += [helper.make_tensor_value_info(n, f, ["b", 2, "p", 4]) for n in names[:2]]
    ins.append(helper.make_tensor_value_info(names[2], f, ["b", "p", 3]))
    outs = [helper.make_tensor_value_info(gp.LOGITS, f, ["b", "s", 5])]
    outs += [helper.make_tensor_value_info(gp.present_of(n), f, None) for n in names]
    nodes = [helper.make_node("Identity", [n], [gp.present_of(n)]) for n in names]
    nodes.append(helper.make_node("Cast", [gp.INPUT_IDS], ["ids_f"], to=f))
    nodes.append(helper.make_node("Unsqueeze", ["ids_f", "axis"], [gp.LOGITS]))
    g = helper.make_graph(nodes, "g", ins, outs,
                          [helper.make_tensor("axis", TensorProto.INT64, [1], [2])])
    onnx.save(helper.make_model(g), str(path))
    return path


def test_the_package_contract_reads_and_feeds_indexer_keys(tmp_path):
    """read_step: an indexer key input is an entry of the self cache, [batch, past, size],
    length 0 at the first step, the past's length read from a key (not its size axis)."""
    layout = gp.read_step(_indexed_step_graph(tmp_path / "model.onnx"))
    entry = layout.cache[2]
    assert (entry.kind, entry.indexer, entry.head_size, entry.present) == (
        gp.INDEXER, True, 3, "present.0.indexer_key")
    assert not layout.unsized()
    assert [p.shape for p in layout.empty_past()] == [(1, 2, 0, 4), (1, 2, 0, 4), (1, 0, 3)]
    grown = [np.zeros((1, 2, 5, 4), np.float32)] * 2 + [np.zeros((1, 5, 3), np.float32)]
    assert layout.past_length(grown) == 5
    assert layout.feed([7], grown)[gp.ATTENTION_MASK].shape == (1, 6)
    with pytest.raises(gp.NotAStep, match="not \\(batch, past, size\\)"):
        bad = onnx.load(str(tmp_path / "model.onnx"))
        bad.graph.input[4].type.tensor_type.shape.dim.add().dim_value = 1
        onnx.save(bad, str(tmp_path / "bad.onnx"))
        gp.read_step(tmp_path / "bad.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["axk2", "hy_v4", "minimax"])
def test_sparse_attention_families_verify(family, tmp_path, monkeypatch):
    """AXK2 and HY-V4 (were OM827) and MiniMax (was OM828) through ``onnxmedic export
    hf:FOLDER``: verified token by token in onnxmedic's own loop."""
    monkeypatch.setattr(family_sweep, "OUT", tmp_path)
    row = family_sweep.run(family, "causal", timeout=600, exporters=False)
    assert (row["outcome"], row["codes"]) == ("verified", []), row
