"""The encoder inputs of an encoder-decoder package, as the task takes them: text through the
folder's tokenizer (ids from the config without one), audio through the folder's feature
extractor (Whisper's log-mel ``input_features``; one built from the config when the folder
has none). OM826: a feature extractor whose frames the encoder cannot take."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from onnxmedic.findings import InputError, error

logger = logging.getLogger(__name__)

STAGE = "inputs"
TEXTS = ("Return the number of items in the list, and the list sorted.",
         "a short one")
TONES = (220.0, 440.0)  # Hz


def encoder_frames(model: Any) -> int | None:
    """The frames Whisper's encoder takes (2 x max_source_positions: its two convolutions
    halve them), None for a model that takes any length."""
    n = getattr(model.config, "max_source_positions", None)
    return 2 * int(n) if n and "input_features" == getattr(model, "main_input_name", "") \
        else None


def default_processor(model: Any) -> Any:
    """A WhisperFeatureExtractor for the config (its mel bins, 10 ms hops, the chunk the
    encoder takes), for a folder without preprocessor_config.json; None when none fits."""
    from transformers import WhisperFeatureExtractor

    frames = encoder_frames(model)
    bins = getattr(model.config, "num_mel_bins", None)
    if frames is None or not bins or frames * 160 % 16000:
        return None
    return WhisperFeatureExtractor(feature_size=int(bins), sampling_rate=16000, hop_length=160,
                                   chunk_length=frames * 160 // 16000, n_fft=400)


def waveforms(rate: int, n: int) -> list[np.ndarray]:
    """``n`` synthetic waveforms of half a second: tones with a slow vibrato, seeded noise."""
    t = np.arange(rate // 2, dtype=np.float64) / rate
    g = np.random.default_rng(0)
    out = []
    for i in range(n):
        f = TONES[i % len(TONES)] * (1 + i // len(TONES))
        wave = 0.5 * np.sin(2 * math.pi * f * t + 3 * np.sin(2 * math.pi * 3 * t))
        out.append((wave + 0.01 * g.standard_normal(t.shape)).astype(np.float32))
    return out


def audio_features(model: Any, processor: Any, n: int) -> torch.Tensor:
    """``n`` waveforms through ``processor`` as input_features; OM826 when its frames are not
    the ones the encoder takes."""
    rate = int(getattr(processor, "sampling_rate", 16000) or 16000)
    enc = processor(waveforms(rate, n), sampling_rate=rate, return_tensors="pt")
    feats = enc["input_features"]
    want = encoder_frames(model)
    bins = getattr(model.config, "num_mel_bins", None)
    if (want is not None and feats.shape[-1] != want) or (bins and feats.shape[1] != bins):
        raise InputError(error(
            "OM826", STAGE, f"the feature extractor gives input_features of shape "
            f"{list(feats.shape[1:])} (mel bins, frames), and the encoder of "
            f"{type(model).__name__} takes [{bins}, {want}] (num_mel_bins, 2 x "
            "max_source_positions): the folder's preprocessor_config.json does not belong to "
            "this model.", suggestion="Save the model's own feature extractor beside it "
            "(processor.save_pretrained(folder)); its feature_size and chunk_length must give "
            "the encoder's mel bins and frames."))
    return feats.to(next(model.parameters()).dtype)


def text_ids(tokenizer: Any, texts: list[str], vocab: int) -> list[list[int]]:
    """Token ids of ``texts`` through ``tokenizer`` (seeded ids without one)."""
    out = []
    for i, text in enumerate(texts):
        if tokenizer is not None:
            ids = [int(t) for t in tokenizer(text)["input_ids"]]
        else:
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(min(4, vocab - 1), vocab, (9 - 2 * i,), generator=g).tolist()
        out.append(ids or [0])
    return out


def encoder_inputs(model: Any, tokenizer: Any = None, processor: Any = None, batch: int = 2,
                   texts: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The encoder's inputs for ``batch`` items: texts padded to one length (their
    attention_mask), or audio features."""
    if getattr(model, "main_input_name", "input_ids") == "input_features":
        processor = processor if processor is not None else default_processor(model)
        if processor is None:
            raise InputError(error(
                "OM826", STAGE, f"{type(model).__name__} takes audio features and no feature "
                "extractor fits its config (the folder has no preprocessor_config.json).",
                suggestion="Save the model's feature extractor beside it."))
        return {"input_features": audio_features(model, processor, batch)}
    texts = list(texts or TEXTS)[:batch]
    ids = text_ids(tokenizer, texts + [texts[-1]] * (batch - len(texts)),
                   int(model.config.vocab_size))
    pad = int(getattr(model.config, "pad_token_id", None) or 0)
    n = max(len(x) for x in ids)
    out = torch.full((len(ids), n), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), n), dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return {"input_ids": out, "attention_mask": mask}
