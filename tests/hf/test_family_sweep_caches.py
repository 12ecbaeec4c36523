"""Cache layers of the family sweep's families that hold state beside their keys and values:
refused before any export with the layer and its state named (OM827), not OM828 on the plain
DynamicCache onnxmedic's step feeds back. Tiny models of the sweep's configs, seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.zoo import family_sweep  # noqa: E402


def test_deepseek_v4s_compressor_state_is_om827():
    """DeepSeek-V4's compressed attention layers (DeepseekV4HCACache, DeepseekV4CSACache)
    keep the compressor's buffers and compressed entries beside the sliding window's keys and
    values; fed back as a plain DynamicCache its forward raised (AttributeError:
    store_compression_weights), blamed as onnxmedic's step inputs (OM828)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from onnxmedic.hf import generation

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "deepseek_v4", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, n_routed_experts=2,
        num_experts_per_tok=1, q_lora_rank=16, o_lora_rank=16, o_groups=2, index_n_heads=2,
        index_head_dim=16, index_topk=4, max_position_embeddings=64, vocab_size=64,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    said = generation.cache_problem(model)
    assert said is not None and said.code == "OM827", said
    assert "0 DeepseekV4HCACache: " in said.message
    assert "buffer_kv[compressor]" in said.message and "compressed_kv[compressor]" in said.message
    assert "1 DeepseekV4CSACache: " in said.message and "buffer_kv[indexer]" in said.message
    assert "--task text-generation" in said.suggestion


def test_a_plain_key_value_cache_is_not_refused():
    """The same check passes a key/value cache with a sliding window (its window a scalar
    tensor) and nothing else: Mistral's, as every verified family of the sweep."""
    from onnxmedic.hf import generation

    model = family_sweep.tiny_model("mistral", "causal")
    assert generation.cache_problem(model) is None
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
    assert generation.unsupported_states(out.past_key_values) == []
