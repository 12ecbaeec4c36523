"""Tiny decoder families saved as local checkpoint folders, each with a tokenizer trained here.

``save_family(name, root)`` writes ``root/name`` with ``save_pretrained`` (config.json,
generation_config.json, model.safetensors) and a byte-level BPE tokenizer trained with the
``tokenizers`` library on the docstrings of Python's standard library (no downloads). The
configs are tiny (hidden 64, 2 layers) but keep what makes each family itself: grouped-query
attention, sliding windows, rotary scaling, tied embeddings, soft-capping, mixtures of experts.

    from bench.zoo.generation import FAMILIES, save_family
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

VOCAB = 384
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
GQA = dict(BASE, num_key_value_heads=2, head_dim=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (model_type, config keys): what each covers in brackets
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(GQA, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("mistral", dict(GQA, sliding_window=8)),  # [sliding window]
    "mixtral": ("mixtral", dict(GQA, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=None)),  # [MoE]
    "qwen2": ("qwen2", dict(GQA, tie_word_embeddings=True)),  # [tied embeddings]
    "qwen3": ("qwen3", dict(GQA)),
    "qwen2_moe": ("qwen2_moe", dict(GQA, **MOE, shared_expert_intermediate_size=64)),
    "qwen3_moe": ("qwen3_moe", dict(GQA, **MOE)),
    "phi3": ("phi3", dict(GQA)),
    "gemma": ("gemma", dict(GQA)),
    "gemma2": ("gemma2", dict(GQA, sliding_window=8, final_logit_softcapping=30.0,
                              attn_logit_softcapping=50.0)),  # [soft-capping, sliding]
    "gemma3_text": ("gemma3_text", dict(GQA, sliding_window=8, final_logit_softcapping=30.0,
                                        layer_types=["sliding_attention", "full_attention"])),
    "granite": ("granite", dict(GQA)),
    "olmo2": ("olmo2", dict(GQA)),
    "smollm3": ("smollm3", dict(GQA)),
    "falcon": ("falcon", dict(BASE, new_decoder_architecture=False, multi_query=True)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB,
                          bos_token_id=1, eos_token_id=2)),
    "gpt_neox": ("gpt_neox", dict(BASE)),
    "gpt_bigcode": ("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                        vocab_size=VOCAB, multi_query=True, bos_token_id=1,
                                        eos_token_id=2)),
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "opt": ("opt", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                        word_embed_proj_dim=64, vocab_size=VOCAB, max_position_embeddings=128,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "stablelm": ("stablelm", dict(GQA)),
    "cohere": ("cohere", dict(GQA)),
    "starcoder2": ("starcoder2", dict(GQA, sliding_window=8)),
    "phi": ("phi", dict(BASE, partial_rotary_factor=0.5)),  # [partial rotary, parallel block]
    "olmo": ("olmo", dict(GQA, clip_qkv=8.0)),  # [clipped q/k/v]
    # [attention sinks, alternating sliding/full layers, MoE]
    "gpt_oss": ("gpt_oss", dict(GQA, intermediate_size=64, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=8)),
    # [ALiBi; its config has use_cache off, and the package still carries the cache]
    "mpt": ("mpt", dict(d_model=64, n_layers=2, n_heads=4, expansion_ratio=2, vocab_size=VOCAB,
                        max_seq_len=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "deepseek_v3": ("deepseek_v3", dict(BASE, num_key_value_heads=4, kv_lora_rank=16,
                                        q_lora_rank=32, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=1, n_group=1, topk_group=1)),
    # [caches with states: a convolution state beside keys and values; Mamba-2 states beside
    # them; Mamba's states alone] packages of one token per step, verified by the own loop
    "lfm2": ("lfm2", dict(GQA, layer_types=["conv", "full_attention"])),
    "falcon_h1": ("falcon_h1", dict(GQA, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                    mamba_d_state=8, mamba_n_groups=1)),
    "mamba": ("mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=8, expand=2,
                            conv_kernel=4, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)),
}
# the non-slow tests' families: GQA with rotary scaling (the shared package), soft-capping with
# sliding windows; the rest run in the slow sweep
FAST = ("llama", "gemma2")

_CORPUS: list[str] = []


def corpus() -> list[str]:
    """Docstrings of a few standard-library modules: text on disk, no download."""
    if not _CORPUS:
        import collections
        import json as json_mod
        import pathlib
        import textwrap

        for mod in (collections, json_mod, pathlib, textwrap, inspect, logging):
            for _, obj in inspect.getmembers(mod):
                doc = inspect.getdoc(obj)
                if doc:
                    _CORPUS.append(doc)
    return _CORPUS


def train_tokenizer(folder: Path, vocab: int = VOCAB) -> Any:
    """A byte-level BPE of ``vocab`` tokens (ids 0-2: <pad>, <s>, </s>) saved in ``folder`` as
    a transformers fast tokenizer; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


def build(name: str) -> torch.nn.Module:
    """The family's tiny causal LM (random weights, seeded), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kw = FAMILIES[name]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **kw)
    return AutoModelForCausalLM.from_config(cfg).eval()


def save_checkpoint(name: str, root: str | Path, make: Any, extra: Any = None) -> Path:
    """``root/name``: ``make(name)``'s checkpoint folder with a tokenizer trained here (and
    whatever ``extra(folder)`` saves), made once."""
    folder = Path(root) / name
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    make(name).save_pretrained(folder)
    train_tokenizer(folder)
    if extra is not None:
        extra(folder)
    (folder / "zoo.json").write_text(json.dumps({"family": name}) + "\n")
    return folder


def save_family(name: str, root: str | Path) -> Path:
    """``root/name``: the family's checkpoint folder with its tokenizer (made once)."""
    return save_checkpoint(name, root, build)


# Qwen2.5-0.5B's published shape (494 M parameters, tied embeddings, 14 query / 2 KV heads):
# the ~0.5 B decoder the speed figures use, with random weights
HALF_B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_half_b(root: str | Path = "build/decoders") -> Path:
    """``root/qwen2-0.5b``: a Qwen2.5-0.5B-shaped checkpoint (float32, random weights seeded,
    with a tokenizer trained here), made once; about 2 GiB on disk."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(root) / "qwen2-0.5b"
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen2", **HALF_B)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder)
    train_tokenizer(folder, vocab=4096)
    (folder / "zoo.json").write_text(json.dumps({"family": "qwen2-0.5b"}) + "\n")
    return folder


if __name__ == "__main__":
    import sys

    print(save_half_b(sys.argv[1] if len(sys.argv) > 1 else "build/decoders"))
