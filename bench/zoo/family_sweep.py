"""Every causal LM and encoder-decoder architecture transformers ships, built from a tiny config,
through ``onnxmedic export hf:FOLDER`` (the default task and backend): verified, refused with a
finding code, or an internal error (OM009, which must appear nowhere).

Families come from transformers' own task mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``). A family's config is bench/zoo/generation.py's
where it has one, else the config class's defaults with every size key it has shrunk (SHRINK);
a family whose tiny model cannot be built (a multimodal config, a required sub-config, more
than MAX_PARAMS parameters) is listed as "no tiny config" with the error. Each export runs in a
process of its own with a timeout, one at a time.

    python bench/zoo/family_sweep.py [--families lfm2,mamba [--again]] [--limit N] [--timeout 300]

Rows go to bench/results/family_sweep.jsonl (committed) as they finish, one family a line (a
later row for the same family replaces the earlier one); the table bench/results/family_sweep.md
is written from that file alone. A later run resumes from it: a family with a row is not run
again unless ``--again`` names it (``--families`` then only chooses and orders what is new).
``--seed-from-table`` rebuilds the rows file from the markdown table (its cells are all it keeps).

A row records the task the export chose (``task``: what ``export hf:FOLDER`` detects from the
saved config), and the table says what a verified row was judged on (CHECKS): "tokens", a
generation package whose greedy tokens equal PyTorch's step by step, or "logits", one forward
graph (text-generation: an encoder's causal-LM class, a class without a cache) compared on its
logits alone. Rows from before ``task`` was recorded take the task their first error names,
else their family's tiny config's (``_fill_tasks``, on the next run or ``--table``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

OUT = ROOT / "build" / "family_sweep"
TABLE = ROOT / "bench" / "results" / "family_sweep.md"
RESULTS = ROOT / "bench" / "results" / "family_sweep.jsonl"
MAX_PARAMS = 20_000_000
STEPS = 8  # greedy tokens compared with PyTorch's (onnxmedic's own default)
# size keys of transformers' configs, shrunk where a config has them
SHRINK: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_inner": 128,
    "d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_heads": 4,
    "num_decoder_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "ffn_dim": 128, "head_dim": 16, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "ffn_hidden_size": 128,
    "n_layers": 2, "n_heads": 4, "max_seq_len": 128, "num_layers_per_block": None,
}

DSA = {"index_topk": 4, "index_head_dim": 16}
# SHRINK's keys changed for a family: attention that takes as many KV heads as query heads
# (the shrunk 2 of 4 raised in PyTorch itself, OM830, a fault of the sweep's config)
# (ProphetNet's config refuses num_hidden_layers and names its layers and heads per stack)
# (DeepSeek Sparse Attention, AXK2's and HY-V4's: an indexer keeping fewer tokens than the
# prompt and the generated ones, so that the sparse selection is exercised, 2048 by default)
SHRINK_FOR: dict[str, dict[str, Any]] = {
    "axk2": {"num_key_value_heads": 4, **DSA}, "bailing_hybrid": {"num_key_value_heads": 4},
    "hy_v4": DSA,
    "zaya": {"num_experts_per_tok": 1},  # ZAYA's config takes one expert a token only
    "prophetnet": {"num_hidden_layers": None, "num_encoder_layers": 2,
                   "num_encoder_attention_heads": 4, "num_decoder_attention_heads": 4},
    # XLNet's max_position_embeddings is a property that raises when set (no length limit)
    "xlnet": {"max_position_embeddings": None},
    # X-MOD's adapters need a language (its forward raises without one: a user calls
    # set_default_language(), or the config names it, as here)
    "xmod": {"default_language": "en_XX"},
}

# multi-head latent attention (a config with kv_lora_rank: DeepSeek-V3, AXK1...): its latent
# and per-part head sizes, which SHRINK's head_dim alone leaves incoherent (the rotary part's
# 64 against a head of 16 raised in PyTorch itself, OM830); as deepseek_v2's below
SHRINK_MLA: dict[str, Any] = {
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "qk_head_dim": 16, "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
}

# configs whose size keys must agree with each other (SHRINK alone breaks them)
CONFIGS: dict[str, dict[str, Any]] = {
    "mamba2": dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2,
                   n_groups=1, state_size=16, conv_kernel=4, chunk_size=16),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    # hybrids: an attention layer among the two (their default patterns start at layer 4)
    "jamba": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, attn_layer_offset=1,
                  attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2),
    "bamba": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, attn_layer_indices=[1],
                  mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16),
    # rotary and latent-attention sizes the shrunk head size leaves incoherent by default
    # Reformer: a causal LM only with is_decoder (its class asserts it), local and LSH
    # attention layers whose chunks fit the sweep's prompt, axial position embeddings whose
    # shape multiplies to max_position_embeddings and whose widths add to hidden_size
    "reformer": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     attention_head_size=16, feed_forward_size=128, max_position_embeddings=128,
                     axial_pos_shape=[8, 16], axial_pos_embds_dim=[16, 48],
                     attn_layers=["local", "lsh"], local_attn_chunk_length=8,
                     lsh_attn_chunk_length=8, num_buckets=4, is_decoder=True),
    "codegen": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=128,
                    rotary_dim=8),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=128, rotary_dim=8),
    # GPT-Neo's layer pattern must cover its layers (its default names 24); a window shorter
    # than the sweep's prompt and tokens, as the local layers' of a released checkpoint
    "gpt_neo": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                    max_position_embeddings=128, attention_types=[[["global", "local"], 1]],
                    window_size=8),
    "deepseek_v2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                        topk_group=1),
    # MiniCPM3's attention takes as many KV heads as query heads (its released checkpoints':
    # the shrunk 2 of 4 raise in its own attention)
    "minicpm3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, intermediate_size=128, kv_lora_rank=16,
                     q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    # zamba ties its hybrid layers' shared block across them: two hybrid layers at least
    "zamba": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=128, n_mamba_heads=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  layers_block_type=["mamba", "hybrid", "hybrid"], attention_hidden_size=128,
                  attention_head_dim=32),
    "zamba2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, intermediate_size=128, n_mamba_heads=8,
                   mamba_headdim=16, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                   layers_block_type=["mamba", "hybrid"], chunk_size=16, num_mem_blocks=1,
                   use_shared_attention_adapter=False, adapter_rank=8, use_mem_rope=False),
    "granitemoehybrid": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128,
                             shared_intermediate_size=64, num_local_experts=4,
                             num_experts_per_tok=2, layer_types=["mamba", "attention"],
                             mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                             mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                             mamba_chunk_size=16),
    "nemotron_h": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128,
                       layers_block_type=["mamba", "moe", "attention", "mlp"],
                       mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=8,
                       conv_kernel=4, expand=2, chunk_size=16, n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=64),
    # RecurrentGemma: its block pattern (recurrent, recurrent, attention) cut to two layers
    # left no attention layer (its cache then cannot say its length: OM830, the sweep's
    # fault); the LRU's width is not a SHRINK key (2560)
    "recurrent_gemma": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128,
                            lru_width=64, block_types=["recurrent", "attention"],
                            attention_window_size=128),
    "falcon_mamba": dict(hidden_size=64, num_hidden_layers=2, state_size=8, expand=2,
                         conv_kernel=4),
    # transformers' default Lfm2MoeConfig has no layer_types (its __init__ then raises); the
    # released LFM2-8B-A1B's pattern: convolution layers and attention ones, dense ones first
    "lfm2_moe": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
                     num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                     layer_types=["conv", "full_attention", "conv"]),
    # Gemma 3n: sliding layers and a global one, the last layers reusing the KV cache of the
    # earlier ones of their kind (as E2B's 10 of 30; both kinds must be left unshared or
    # its config raises), AltUp, LAuReL, per-layer inputs and the sparse MLP of the first ones
    "gemma3n_text": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         layer_types=["sliding_attention", "full_attention",
                                      "sliding_attention", "full_attention"],
                         num_kv_shared_layers=2, sliding_window=8, max_position_embeddings=128,
                         vocab_size_per_layer_input=384, hidden_size_per_layer_input=16,
                         laurel_rank=8, altup_num_inputs=4,
                         activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0]),
    # Gemma 4: sliding layers and global ones (the last one global), the global ones with a
    # head twice as wide (global_head_dim, 512 against 256 by default) and a partial rotary
    # part; the shrunk head_dim alone is per-layer ambiguous in its config
    "gemma4_text": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, global_head_dim=32,
                        intermediate_size=128, max_position_embeddings=128, sliding_window=8,
                        layer_types=["sliding_attention", "sliding_attention",
                                     "sliding_attention", "full_attention"],
                        vocab_size_per_layer_input=384, hidden_size_per_layer_input=16),
    # Qwen4-Exp: gated-delta-net layers and an indexed (QSA) attention one in four, whose token
    # indexer's sizes have no default (None // None); MoE with a shared expert, hyper-
    # connections, and the hashed n-gram per-layer embedding (PLE) on a layer
    "qwen4_exp_text": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                           linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4,
                           moe_intermediate_size=32, shared_expert_intermediate_size=64,
                           num_experts=4, num_experts_per_tok=2, hc_count=4, hc_lowrank=8,
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                           indexer_budget=8, indexer_compress_ratio=4, ple_layer_ids=[1],
                           ple_embed_dim=32, ngram_size=3, heads_per_ngram=2,
                           ngram_vocab_size_base=97, split_ngram_parts=1),
    # dots.llm1: MoE (routed and shared experts, none by default: int * None) after a dense
    # first layer, with as many KV heads as query heads, as its released checkpoint's
    "dots1": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                  first_k_dense_replace=1, max_position_embeddings=128),
    # dots3 note: per-layer attention sizes (per_layer_config: the shrinker's MLA keys are
    # then ambiguous per layer, its hasattr raises), an indexed (sparse) attention layer and a
    # sliding one (an indexer of 16 heads: with 2, its scores tie in TopK, OM860), a dense MLP
    # layer and an MoE one
    "dots3_note_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=128,
                            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, kv_lora_rank=16, q_lora_rank=32,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=16,
                            index_head_dim=16, index_n_heads=16, index_topk=8,
                            layer_types=["indexed_attention", "sliding_attention"],
                            mlp_layer_types=["dense", "sparse"], per_layer_config={},
                            max_position_embeddings=128, sliding_window=8),
    # Cohere Compass (North): rotary parameters per layer kind (none by default: KeyError),
    # sliding layers with rotary positions (M-RoPE sections of the shrunk head) and a global
    # one without (NoPE), one in four
    "cohere_compass_text": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128,
                                max_position_embeddings=128, sliding_window=8,
                                layer_types=["sliding_attention", "sliding_attention",
                                             "sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": dict(
                                    rope_type="default", rope_theta=10000.0,
                                    mrope_section=[4, 2, 2]), "full_attention": None}),
    # BLT: its byte patcher, local encoder and decoder and global transformer, whose widths
    # must agree across them (hidden_size_global) and whose hashed n-gram byte embeddings
    # (500002 rows by default) the shrinker does not know
    "blt": dict(max_position_embeddings=128, encoder_hash_byte_group_vocab=1024,
                patcher_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, intermediate_size=128, head_dim=16,
                                    max_position_embeddings=128),
                encoder_config=dict(hidden_size=64, hidden_size_global=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=4,
                                    intermediate_size=128, max_position_embeddings=128),
                decoder_config=dict(hidden_size=64, hidden_size_global=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4,
                                    intermediate_size=128, head_dim=16,
                                    max_position_embeddings=128),
                global_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=128, head_dim=16,
                                   max_position_embeddings=128)),
}


# families transformers maps to a causal-LM class that no config of theirs builds: the row
# says why ("no tiny config") instead of the class's own error
NO_TINY: dict[str, str] = {
    **{m: f"AutoModelForCausalLM maps {m}'s config (a text encoder, an audio encoder and a "
          f"decoder) to {cls}, whose __init__ takes the decoder's config alone "
          f"({m}_decoder, which AutoModelForCausalLM does not map): no {m} config builds it "
          "(AttributeError: no attribute 'dropout'); its generation is of audio codebooks"
       for m, cls in (("musicgen", "MusicgenForCausalLM"),
                      ("musicgen_melody", "MusicgenMelodyForCausalLM"))},
    # speculative-decoding drafters: no checkpoint of theirs generates from a prompt alone
    **{m: f"{cls} is a speculative-decoding drafter: its forward ignores input_ids and takes "
          "the target model's embeddings (inputs_embeds) and its last layers' keys and values "
          "(shared_kv_states), every layer reading them (num_kv_shared_layers = "
          "num_hidden_layers); it does not generate from a prompt on its own"
       for m, cls in (("gemma4_assistant", "Gemma4AssistantForCausalLM"),
                      ("gemma4_unified_assistant", "Gemma4UnifiedAssistantForCausalLM"))},
}


# Gemma 4 unified's text model: Gemma 4's text config (per-layer head sizes)
CONFIGS["gemma4_unified_text"] = CONFIGS["gemma4_text"]


def families() -> list[tuple[str, str]]:
    """(model_type, "causal" or "seq2seq") of every architecture transformers maps to the two
    generation tasks, sorted."""
    from transformers.models.auto import modeling_auto as ma

    seq2seq = set(ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    causal = set(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - seq2seq
    return sorted([(m, "causal") for m in causal] + [(m, "seq2seq") for m in seq2seq])


def _shrunk(base: Any, model_type: str) -> dict[str, Any]:
    """The size keys of config ``base`` shrunk (SHRINK, SHRINK_MLA, SHRINK_FOR), its layer
    pattern cut to its layers (one of each kind first), and each nested config (a multimodal
    one's text and vision towers, an encoder-decoder's two stacks) shrunk alike (CONFIGS's
    where its model type has one), as a dict."""
    from transformers import PretrainedConfig

    from bench.zoo.generation import VOCAB

    mla = SHRINK_MLA if hasattr(base, "kv_lora_rank") else {}
    shrink = {**SHRINK, **mla, **SHRINK_FOR.get(model_type, {})}
    keys = {k: v for k, v in shrink.items() if v is not None and hasattr(base, k)}
    if "layer_types" in base.to_dict() and isinstance(base.layer_types, list):
        n = keys.get("num_hidden_layers", len(base.layer_types))
        kinds = list(dict.fromkeys(base.layer_types))  # one of each kind first
        keys["layer_types"] = (kinds + list(base.layer_types))[:max(n, len(kinds))]
        keys["num_hidden_layers"] = len(keys["layer_types"])
    for name, sub in vars(base).items():
        if isinstance(sub, PretrainedConfig):
            # a text tower whose family has its own tiny config (Gemma 3n's, Gemma 4's,
            # Qwen4-Exp's: SHRINK alone leaves their per-layer keys incoherent) takes it
            # (alone: the default tower's per-layer keys would not fit its layers)
            own = CONFIGS.get(getattr(sub, "model_type", ""))
            inner = dict(own) if own is not None else _shrunk(sub, model_type)
            if hasattr(sub, "vocab_size"):
                inner.update(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
            keys[name] = ({"model_type": sub.model_type, **inner} if own is not None
                          else {**sub.to_dict(), **inner})
    return keys


def tiny_config(model_type: str, kind: str) -> Any:
    """The family's tiny config (no weights); raises why it cannot be built."""
    from transformers import AutoConfig

    from bench.zoo.generation import FAMILIES, VOCAB

    if model_type in NO_TINY:
        raise ValueError(NO_TINY[model_type])
    if model_type in FAMILIES:
        cfg = AutoConfig.for_model(*[FAMILIES[model_type][0]], **FAMILIES[model_type][1])
    elif model_type in CONFIGS:
        cfg = AutoConfig.for_model(model_type, **CONFIGS[model_type], vocab_size=VOCAB,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        keys = _shrunk(AutoConfig.for_model(model_type), model_type)
        keys.update(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        cfg = AutoConfig.for_model(model_type, **keys)
    start = getattr(cfg, "decoder_start_token_id", None)
    if kind == "seq2seq" and (start is None or start >= cfg.vocab_size):
        # as the family's released checkpoints (LongT5's config has none; Marian's default is
        # its pad token, 58100, past the tiny vocabulary)
        cfg.decoder_start_token_id = cfg.pad_token_id
    return cfg


def tiny_model(model_type: str, kind: str) -> Any:
    """The family's tiny model (random weights, seeded); raises why it cannot be built."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    cfg = tiny_config(model_type, kind)
    auto = AutoModelForSeq2SeqLM if kind == "seq2seq" else AutoModelForCausalLM
    with torch.device("meta"):  # counted before any memory is taken (a multimodal default
        n = sum(p.numel() for p in auto.from_config(cfg).parameters())  # is billions)
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f} M parameters after shrinking (> {MAX_PARAMS / 1e6:.0f} M)")
    torch.manual_seed(0)
    model = auto.from_config(cfg).eval()
    with torch.no_grad():  # routers transformers initialises to zero (AFMoE's) score every
        for name, p in model.named_parameters():  # expert alike: every token routed by ties
            if p.ndim == 2 and "router" in name and not p.any():  # (OM860); a released
                p.normal_(0.0, 0.02)  # checkpoint's are trained
    return model


# what a verified row was judged on, by the task onnxmedic chose (the column "onnxmedic")
CHECKS = {
    "tokens": "a generation package (text-generation-with-past, "
              "text2text-generation-with-past): its greedy tokens equal PyTorch's, step by step",
    "logits": "one forward graph (text-generation: an encoder's causal-LM class not "
              "configured as a decoder, or a class that returns no cache) judged on its "
              "logits alone; no generation loop ran",
}


def check_of(task: str | None) -> str | None:
    """What onnxmedic's verification of ``task`` compares: "tokens" for a generation task
    (a package generated step by step), "logits" for any other (one forward pass); None
    when the task is not known."""
    from onnxmedic.hf.tasks import GENERATION

    if not task:
        return None
    return "tokens" if task in GENERATION else "logits"


def task_of(config: dict[str, Any]) -> str | None:
    """The task ``export hf:FOLDER`` chooses for a checkpoint of this config.json (the task
    detection it runs itself, with no --task given)."""
    from onnxmedic.hf.tasks import detect_task

    return detect_task(config)


def tiny_task(model_type: str, kind: str) -> str | None:
    """The task of the family's tiny checkpoint, from its config alone (no weights): the
    class its Auto class builds is the architecture its saved config names."""
    from onnxmedic.hf.tasks import classes_for

    cfg = tiny_config(model_type, kind)
    mapping = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES" if kind == "seq2seq"
               else "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    arch = classes_for(mapping, cfg.model_type)
    return task_of({**cfg.to_dict(), "architectures": list(arch[:1])}) if arch else None


def _export(folder: Path, out: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "onnxmedic.cli", "export", f"hf:{folder}", "-o", str(out),
           "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "codes": [], "seconds": round(timeout)}
    seconds = round(time.perf_counter() - t0, 1)
    try:
        res = json.loads(p.stdout)
    except ValueError:
        return {"outcome": "no JSON", "codes": [], "exit": p.returncode, "seconds": seconds,
                "stderr": p.stderr[-400:]}
    errors = [f["code"] for f in res.get("findings", []) if f.get("severity") == "error"]
    outcome = ("verified" if p.returncode == 0 else "internal error"
               if p.returncode == 3 or "OM009" in errors else "refused")
    return {"outcome": outcome, "codes": errors, "exit": p.returncode, "seconds": seconds,
            "first": next(
                (f["message"][:160] for f in res.get("findings", [])
                 if f.get("severity") == "error"), "")}


def exporters_child(folder: Path, kind: str, out: Path) -> dict[str, Any]:
    """transformers.exporters' ``export_for_generation`` on the saved folder and greedy
    generation through its ONNX Runtime runners, compared with PyTorch's greedy tokens (the
    peers benches' own calls: bench/peers/generation.py, bench/peers/seq2seq.py)."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if kind == "seq2seq":
        from bench.peers import seq2seq as peer
        from onnxmedic.hf.seq2seq import start_token
        from onnxmedic.hf.seq2seq_verify import torch_generation as torch_seq2seq

        model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        enc = peer._inputs(model, tok, None)
        start = start_token(model)
        want, _ = torch_seq2seq(model, enc, STEPS, start)
        row = peer._exporters(model, tok, None, folder, out, enc, start, STEPS)
    else:
        from bench.peers import generation as peer
        from onnxmedic.hf.gen_verify import torch_generation

        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        want, _ = torch_generation(model, [int(t) for t in tok(peer.PROMPT)["input_ids"]],
                                   STEPS)
        row = peer._exporters(model, tok, folder, out, STEPS)
    got = row.get("tokens")
    row["correct"] = bool(got) and "error" not in row and got == want[:len(got)] and (
        len(got) == len(want))
    row["torch_tokens"] = want
    return row


def _exporters(folder: Path, kind: str, timeout: float) -> dict[str, Any]:
    """:func:`exporters_child` in a process of its own, with a timeout: the ``exporters``
    column ("correct", "wrong tokens", "fails: ...", "timeout")."""
    import shutil

    out = OUT / "exporters" / folder.name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--exporters-child", str(folder),
           kind, str(out)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"exporters": "timeout"}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    try:
        res = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
        return {"exporters": "fails: " + (lines[-1] if lines else f"exit {p.returncode}")[:160]}
    if "error" in res:
        return {"exporters": "fails: " + res["error"][:160]}
    return {"exporters": "correct" if res["correct"] else "wrong tokens"}


def run(model_type: str, kind: str, timeout: float, row: dict[str, Any] | None = None,
        exporters: bool = True) -> dict[str, Any]:
    """One family's row: built and saved (bench/zoo/generation.py's tokenizer), exported by
    onnxmedic and (``exporters``) by transformers.exporters; the part ``row`` (an earlier
    run's) already has is kept."""
    import shutil

    from bench.zoo.generation import save_checkpoint

    row = dict(row or {"family": model_type, "kind": kind})
    if row.get("outcome") == "no tiny config":
        return row
    if "outcome" not in row:  # run again whole: the checkpoint of today's config
        shutil.rmtree(OUT / "ckpt" / model_type, ignore_errors=True)
    try:
        folder = save_checkpoint(model_type, OUT / "ckpt",
                                 lambda name: tiny_model(name, kind))
    except Exception as e:  # noqa: BLE001 - the row says why no tiny model
        shutil.rmtree(OUT / "ckpt" / model_type, ignore_errors=True)
        return {**row, "outcome": "no tiny config", "codes": [],
                "first": f"{type(e).__name__}: {e}"[:160]}
    if "outcome" not in row:
        # the task the export below chooses (what its verification compares: check_of)
        row["task"] = task_of(json.loads((folder / "config.json").read_text()))
        out = OUT / "pkg" / model_type
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        row.update(_export(folder, out, timeout))
        shutil.rmtree(out, ignore_errors=True)
    if exporters and "exporters" not in row:
        row.update(_exporters(folder, kind, timeout))
    return row


def table(rows: list[dict[str, Any]], command: str, left: list[str]) -> str:
    """The markdown table of ``rows``: the command, date and machine, the totals, the rows."""
    ours, peer = _counts(rows, "outcome"), _counts(rows, "exporters")
    lines = [
        "# Family sweep: every causal LM and encoder-decoder transformers ships, tiny",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {platform.system()}",
        "",
        "| families run | onnxmedic verified | refused | no tiny config | OM009 "
        "| transformers.exporters correct | wrong tokens | fails | not run |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {len(rows)} | {ours.get('verified', 0)} | {ours.get('refused', 0)} "
        f"| {ours.get('no tiny config', 0)} "
        f"| {sum('OM009' in r.get('codes', []) or r['outcome'] == 'internal error' for r in rows)}"
        f" | {peer.get('correct', 0)} | {peer.get('wrong tokens', 0)} "
        f"| {sum(v for k, v in peer.items() if k not in ('correct', 'wrong tokens', '-'))} "
        f"| {peer.get('-', 0)} |",
        "",
        *_comparison(rows),
        "",
        f"not run: {', '.join(left) if left else 'none'}",
        "",
        *[f"verified ({k}): {v}." for k, v in CHECKS.items()],
        "",
        "| family | kind | task | onnxmedic | error codes | s | first error "
        "| transformers.exporters |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["family"]):
        first = r.get("first", "").replace("|", "/").replace("\n", " ")
        peer_cell = r.get("exporters", "-").replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['family']} | {r['kind']} | {r.get('task') or ''} | {_outcome(r)} | "
                     f"{' '.join(r.get('codes', []))} | {r.get('seconds', '')} | {first} | "
                     f"{peer_cell} |")
    return "\n".join(lines) + "\n"


def _outcome(row: dict[str, Any]) -> str:
    """The "onnxmedic" cell: the outcome, and for a verified row what it was judged on."""
    check = check_of(row.get("task")) if row["outcome"] == "verified" else None
    return f"{row['outcome']} ({check})" if check else row["outcome"]


def _comparison(rows: list[dict[str, Any]]) -> list[str]:
    """The lines under the totals: the rows that are neither verified nor refused (a
    timeout), refusals by first error code, and onnxmedic against transformers.exporters on
    the families both were run on (its cell is not "-")."""
    refused: dict[str, int] = {}
    for r in rows:
        if r["outcome"] == "refused":
            code = (r.get("codes") or ["(none)"])[0]
            refused[code] = refused.get(code, 0) + 1
    both = [r for r in rows if r.get("exporters", "-") != "-"
            and r["outcome"] != "no tiny config"]
    ours = {r["family"] for r in both if r["outcome"] == "verified"}
    peer = {r["family"] for r in both if r["exporters"] == "correct"}
    # rows of no column of the totals: onnxmedic's export past the timeout, or no JSON
    other = sorted(f"{r['family']} ({r['outcome']})" for r in rows if r["outcome"] not in (
        "verified", "refused", "no tiny config", "internal error"))
    verified = [r for r in rows if r["outcome"] == "verified"]
    by = {k: sorted(r["family"] for r in verified if check_of(r.get("task")) == k)
          for k in CHECKS}
    unknown = len(verified) - sum(len(v) for v in by.values())
    return [
        f"onnxmedic verified by greedy tokens: {len(by['tokens'])}; on logits only: "
        f"{len(by['logits'])} ({', '.join(by['logits']) or 'none'})"
        + (f"; task not recorded: {unknown}" if unknown else ""),
        "",
        "neither verified nor refused: " + (", ".join(other) or "none"),
        "",
        "refused, by first error code: " + (", ".join(
            f"{c} {n}" for c, n in sorted(refused.items())) or "none"),
        "",
        f"on the {len(both)} families both were run on: onnxmedic verified {len(ours)}, "
        f"transformers.exporters correct {len(peer)}; onnxmedic only: "
        f"{', '.join(_judged(sorted(ours - peer), by['logits'])) or 'none'}; "
        "transformers.exporters only: "
        f"{', '.join(sorted(peer - ours)) or 'none'}",
    ]


def _judged(families: list[str], logits: list[str]) -> list[str]:
    """``families``, those onnxmedic verified on logits only marked so (transformers.exporters'
    cell is judged on greedy tokens)."""
    return [f"{f} (logits)" if f in logits else f for f in families]


def _counts(rows: list[dict[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        v = r.get(key, "-").split(":")[0]
        out[v] = out.get(v, 0) + 1
    return out


def load_rows(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The rows of ``path`` (default RESULTS) by family (a later line replaces an earlier
    one); empty if none."""
    path = path or RESULTS
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["family"]] = r
    return done


def save_rows(done: dict[str, dict[str, Any]], path: Path | None = None) -> None:
    """``done`` to ``path`` (default RESULTS), sorted by family, written whole through a
    temporary file."""
    path = path or RESULTS
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(done[k], sort_keys=True) + "\n" for k in sorted(done)))
    tmp.replace(path)


def rows_from_table(text: str) -> dict[str, dict[str, Any]]:
    """The rows of a family_sweep.md table (family, kind, task, outcome, codes, seconds, first
    error, exporters column; a "-" exporters cell is a row transformers.exporters was not run
    on; a table from before the task column has seven)."""
    done: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) not in (7, 8) or cells[0] in ("family", "---") or cells[1] not in (
                "causal", "seq2seq"):
            continue
        if len(cells) == 7:
            cells.insert(2, "")
        family, kind, task, outcome, codes, seconds, first, peer = cells
        row: dict[str, Any] = {"family": family, "kind": kind,
                               "outcome": outcome.split(" (")[0], "codes": codes.split(),
                               "first": first}
        if task:
            row["task"] = task
        if seconds:
            row["seconds"] = float(seconds)
        if peer != "-":
            row["exporters"] = peer
        done[family] = row
    return done


def recorded_task(row: dict[str, Any]) -> str | None:
    """The task a row's first error names ("cannot export for TASK: ..."), None if none."""
    from onnxmedic.hf.tasks import ALL_TASKS

    named = re.match(r"cannot export for ([a-z0-9-]+):", row.get("first", ""))
    return named.group(1) if named and named.group(1) in ALL_TASKS else None


def _fill_tasks(done: dict[str, dict[str, Any]]) -> bool:
    """The task of each row from before rows recorded it: the one its first error names
    (:func:`recorded_task`: the task it ran, which today's detection may no longer choose),
    else its family's tiny config's (no weights: :func:`tiny_task`); whether any row
    changed."""
    changed = False
    for family, row in done.items():
        if "task" in row or row["outcome"] == "no tiny config":
            continue
        try:
            task = recorded_task(row) or tiny_task(family, row["kind"])
        except Exception:  # noqa: BLE001 - a config that no longer builds: left unknown
            log.warning("%s: no task (its tiny config does not build)", family, exc_info=True)
            continue
        if task:
            row["task"], changed = task, True
    return changed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="comma-separated model types, run in this order "
                    "(default: all); those with a row already are skipped")
    ap.add_argument("--again", action="store_true",
                    help="run the --families named again, whole, even if they have a row")
    ap.add_argument("--limit", type=int, help="at most this many families this run")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--budget", type=float, help="start no family after this many seconds")
    ap.add_argument("--no-exporters", action="store_true",
                    help="leave the transformers.exporters column out of new rows")
    ap.add_argument("--table", action="store_true",
                    help="only write the table from the rows run so far")
    ap.add_argument("--seed-from-table", action="store_true",
                    help="write the rows file from the markdown table's rows, then stop")
    ap.add_argument("--exporters-child", nargs=3, metavar=("FOLDER", "KIND", "OUT"),
                    help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.exporters_child:
        folder, kind, out = ns.exporters_child
        print(json.dumps(exporters_child(Path(folder), kind, Path(out))), flush=True)
        return
    if ns.seed_from_table:
        save_rows(rows_from_table(TABLE.read_text()))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    done = load_rows()
    kinds = dict(families())
    if ns.families:
        todo = [(m, kinds[m]) for m in ns.families.split(",") if m in kinds]  # in this order
        if ns.again:
            for f in todo:  # named families are run again, whole
                done.pop(f[0], None)
        else:
            todo = [f for f in todo if f[0] not in done]
    else:
        # first the exporters column of families run before it existed (cheaper: onnxmedic's
        # row is kept), then families not run
        todo = ([f for f in families() if f[0] in done and "exporters" not in done[f[0]]
                 and not ns.no_exporters] + [f for f in families() if f[0] not in done])
    ran, t0 = 0, time.perf_counter()
    for model_type, kind in [] if ns.table else todo:
        if ns.limit is not None and ran >= ns.limit:
            break
        if ns.budget is not None and time.perf_counter() - t0 > ns.budget:
            break
        row = run(model_type, kind, ns.timeout, done.get(model_type),
                  exporters=not ns.no_exporters)
        ran += 1
        done[model_type] = row
        print(json.dumps(row), flush=True)
        save_rows(done)
    if _fill_tasks(done):
        save_rows(done)
    left = [m for m, _ in families() if m not in done]
    command = (f"OMP_NUM_THREADS=1 python bench/zoo/family_sweep.py --timeout {ns.timeout:g}"
               " (repeated: each run adds the rows not yet run)")
    TABLE.write_text(table(list(done.values()), command.strip(), left))


if __name__ == "__main__":
    main()
