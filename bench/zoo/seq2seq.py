"""Tiny encoder-decoders saved as local checkpoint folders: T5 (and a Flan-T5-shaped T5), BART,
Marian, mBART and Whisper, each with the BPE tokenizer of bench/zoo/generation.py (trained
here, no downloads); Whisper also with a ``WhisperFeatureExtractor`` built locally
(``preprocessor_config.json``) whose frames match the tiny encoder's positions.

    from bench.zoo.seq2seq import ENCODER_DECODERS, save_encoder_decoder
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from bench.zoo.generation import VOCAB, save_checkpoint

logger = logging.getLogger(__name__)

IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
           decoder_start_token_id=1)
BARTLIKE = dict(IDS, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                max_position_embeddings=128, init_std=0.5)
# Whisper: 16 mel bins, Whisper's 30 s chunks -> 3000 frames = 2 x max_source_positions (the
# frames onnxruntime-genai's Whisper takes)
WHISPER = dict(BARTLIKE, num_mel_bins=16, max_source_positions=1500, max_target_positions=64,
               begin_suppress_tokens=None, suppress_tokens=None, forced_decoder_ids=None)
WHISPER_AUDIO = dict(feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=30,
                     n_fft=400)

# name -> (model_type, config keys)
ENCODER_DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "t5": ("t5", dict(IDS, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, initializer_factor=1.5,
                      decoder_start_token_id=0)),  # [relative position bias]
    # T5 v1.1's shape, Flan-T5's and mT5's: gated GELU (tanh) feed-forward, untied head
    "flan_t5": ("t5", dict(IDS, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                           num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                           initializer_factor=1.5, feed_forward_proj="gated-gelu",
                           tie_word_embeddings=False, decoder_start_token_id=0)),
    "bart": ("bart", dict(BARTLIKE, forced_eos_token_id=2)),  # [learned positions, offset 2]
    "marian": ("marian", dict(BARTLIKE, decoder_start_token_id=0)),  # [sinusoidal positions]
    "mbart": ("mbart", dict(BARTLIKE)),  # [pre-norm, final layer norms]
    "whisper": ("whisper", WHISPER),  # [audio encoder, conv front end]
}
AUDIO = ("whisper",)


def build(name: str) -> torch.nn.Module:
    """The tiny encoder-decoder ``name`` (random weights, seeded), in eval mode."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    model_type, kw = ENCODER_DECODERS[name]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **kw)
    auto = AutoModelForSpeechSeq2Seq if name in AUDIO else AutoModelForSeq2SeqLM
    return auto.from_config(cfg).eval()


def feature_extractor() -> Any:
    """The tiny Whisper's feature extractor (16 mel bins, 30 s of audio -> 3000 frames)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(**WHISPER_AUDIO)


def save_encoder_decoder(name: str, root: str | Path) -> Path:
    """``root/name``: the checkpoint folder with its tokenizer (and, for Whisper, its
    preprocessor_config.json), made once."""
    extra = (lambda folder: feature_extractor().save_pretrained(folder)) if name in AUDIO else None
    return save_checkpoint(name, root, build, extra)
