"""Tiny Hugging Face checkpoints saved as local folders (no downloads): a model built from a
tiny config with ``from_config`` and ``save_pretrained``, and a tokenizer trained here with the
``tokenizers`` library."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 128
CORPUS = ["onnxmedic exports this sentence and checks every number it computes.",
          "a short one", "what does onnxmedic check?", "who exports it?",
          "the model is exported to onnx", "the numbers are checked against pytorch by hand",
          "a photo of a cat", "a photo of two dogs on the grass",
          "the quick brown fox jumps over the lazy dog"] * 4
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             vocab_size=VOCAB, max_position_embeddings=64)

# name -> (model_type, Auto class, config keywords)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("bert", "AutoModelForMaskedLM", SMALL),
    "bert-base": ("bert", "AutoModel", SMALL),
    "bert-cls": ("bert", "AutoModelForSequenceClassification", dict(SMALL, num_labels=3)),
    "bert-tok": ("bert", "AutoModelForTokenClassification", dict(SMALL, num_labels=5)),
    "bert-qa": ("bert", "AutoModelForQuestionAnswering", SMALL),
    "bert-mc": ("bert", "AutoModelForMultipleChoice", SMALL),
    "distilbert": ("distilbert", "AutoModelForSequenceClassification",
                   dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=VOCAB,
                        max_position_embeddings=64, num_labels=2)),
    "roberta": ("roberta", "AutoModelForMaskedLM", dict(SMALL, pad_token_id=1)),
    "gpt2": ("gpt2", "AutoModelForCausalLM",
             dict(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64,
                  bos_token_id=0, eos_token_id=0)),
    # a causal LM that keeps no cache (its config has no use_cache): text-generation
    "openai-gpt": ("openai-gpt", "AutoModelForCausalLM",
                   dict(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64)),
    # decoders whose cache holds more than keys and values: LFM2's convolution state,
    # Falcon-H1's Mamba-2 states beside its keys and values
    "lfm2": ("lfm2", "AutoModelForCausalLM",
             dict(SMALL, num_key_value_heads=1, layer_types=["conv", "full_attention"],
                  bos_token_id=0, eos_token_id=0)),
    "falcon_h1": ("falcon_h1", "AutoModelForCausalLM",
                  dict(SMALL, num_key_value_heads=1, head_dim=16, mamba_d_ssm=32,
                       mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                       bos_token_id=0, eos_token_id=0)),
    "mamba": ("mamba", "AutoModelForCausalLM",
              dict(hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
                   vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    # a hybrid whose layer pattern (attention at layer 4 of every 8) leaves 2 layers without
    # attention: transformers' cache cannot say its length, generate() raises
    "jamba-noattn": ("jamba", "AutoModelForCausalLM",
                     dict(SMALL, num_key_value_heads=1, mamba_d_state=8, mamba_d_conv=4,
                          mamba_expand=2, num_experts=2, num_experts_per_tok=1,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    # a hybrid with no attention layer (its default pattern): generate() raises, and
    # onnxruntime-genai's builder says it serves the architecture
    "granitemoehybrid-noattn": ("granitemoehybrid", "AutoModelForCausalLM",
                                dict(SMALL, num_key_value_heads=1, shared_intermediate_size=32,
                                     num_local_experts=2, num_experts_per_tok=1,
                                     mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                     mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                     mamba_chunk_size=16, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=0)),
    # multi-head latent attention with fewer KV heads than query heads: generate() runs (it
    # prefills, then adds one token at a time), a step of several new tokens after a past
    # raises in transformers' own MiniCPM3 attention
    "minicpm3": ("minicpm3", "AutoModelForCausalLM",
                 dict(SMALL, num_key_value_heads=1, kv_lora_rank=8, q_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                      bos_token_id=0, eos_token_id=0)),
    "vit": ("vit", "AutoModelForImageClassification",
            dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, image_size=32, patch_size=8, num_labels=3)),
    "segformer": ("segformer", "AutoModelForSemanticSegmentation",
                  dict(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 24, 32],
                       num_attention_heads=[1, 1, 1, 2], mlp_ratios=[2, 2, 2, 2],
                       decoder_hidden_size=32, num_labels=4)),
    "wav2vec2": ("wav2vec2", "AutoModelForAudioClassification",
                 dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, conv_dim=(16, 16), conv_kernel=(10, 3),
                      conv_stride=(5, 2), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=2, vocab_size=VOCAB,
                      do_stable_layer_norm=False, num_labels=3, classifier_proj_size=16)),
    "yolos": ("yolos", "AutoModelForObjectDetection",
              dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, image_size=[32, 32], patch_size=8,
                   num_detection_tokens=5, num_labels=3)),
}


def tokenizer(kind: str = "wordpiece") -> Any:
    """A tokenizer trained here on CORPUS: WordPiece with [CLS]/[SEP] (BERT-like), or
    byte-level BPE with an end-of-text token (GPT-2-like)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
            vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:100]))
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                       bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=VOCAB - 8, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def build(name: str) -> torch.nn.Module:
    """The tiny model ``name`` of MODELS, seeded, in eval mode."""
    import transformers

    model_type, auto, kw = MODELS[name]
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    return getattr(transformers, auto).from_config(cfg).eval()


def clip() -> torch.nn.Module:
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=VOCAB,
                                      max_position_embeddings=32),
                     vision_config=dict(hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64,
                                        image_size=32, patch_size=8),
                     projection_dim=16)
    return CLIPModel(cfg).eval()


def save(folder: Path, name: str, *, tok: str | None = "wordpiece",
         bin_weights: bool = False) -> Path:
    """Save the tiny model ``name`` (and a trained tokenizer unless ``tok`` is None) there."""
    model = clip() if name == "clip" else build(name)
    model.save_pretrained(folder)
    if bin_weights:  # the legacy pickle format, as old checkpoints have it
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    if tok is not None:
        tokenizer(tok).save_pretrained(folder)
    return folder
