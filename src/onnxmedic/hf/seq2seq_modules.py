"""The PyTorch side of an encoder-decoder package, shared by its export (hf/seq2seq.py) and its
verification (hf/seq2seq_verify.py): the names of the package's files; the wrappers that are
exported (an encoder that also returns every layer's cross-attention cache; a decoder step
with past); and the encoder inputs as the task takes them: text through the folder's tokenizer
(ids from the config without one), audio through the folder's feature extractor (Whisper's
log-mel ``input_features``; one built from the config when the folder has none). OM826: a
feature extractor whose frames the encoder cannot take."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from onnxmedic.findings import InputError, error
from onnxmedic.genpackage import DECODER_FILES, ENCODER_FILE
from onnxmedic.hf.generation import flat_cache

ENCODER, DECODER = ENCODER_FILE, DECODER_FILES[1]  # the contract's (optimum's) file names
CROSS_RULE = "the encoder attention mask and the cross-attention cache cover the same positions"


def split_cache(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The self-attention and the cross-attention caches of an ``EncoderDecoderCache`` as
    flat [k0, v0, k1, v1, ...] lists."""
    return flat_cache(cache.self_attention_cache), flat_cache(cache.cross_attention_cache)


def interleave(selfs: list[torch.Tensor], cross: list[torch.Tensor]) -> list[torch.Tensor]:
    """optimum's order: per layer decoder key, decoder value, encoder key, encoder value."""
    return [t for i in range(0, len(selfs), 2)
            for t in (selfs[i], selfs[i + 1], cross[i], cross[i + 1])]


def main_input(model: torch.nn.Module) -> str:
    """The encoder's main input: input_ids (text) or input_features (Whisper)."""
    return str(getattr(model, "main_input_name", "input_ids") or "input_ids")


def start_token(model: Any) -> int | None:
    """The decoder's first token (decoder_start_token_id of the generation config or the
    config), or None when neither says."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        value = getattr(cfg, "decoder_start_token_id", None) if cfg is not None else None
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def no_start_token(model: Any, stage: str) -> Any:
    """OM824: the model names no first decoder token (start_token is None)."""
    return error("OM824", stage, f"{type(model).__name__} names no first decoder token "
                 "(decoder_start_token_id in generation_config.json or config.json): "
                 "generation cannot start.", suggestion="Set decoder_start_token_id in the "
                 "checkpoint's config (the model card says which token its decoder starts "
                 "from).")


def encoder_outputs(hidden: torch.Tensor) -> Any:
    """The encoder's output as a model's forward takes it back (``encoder_outputs=``):
    transformers' ``MoEModelOutput`` (a ``BaseModelOutput`` with the routers' fields, None
    here), which a model reads by index (``[0]``) or by name (ProphetNet's
    ``.last_hidden_state``, Switch Transformers' and NLLB-MoE's ``.router_logits``, where a
    plain tuple raised AttributeError)."""
    from transformers.modeling_outputs import MoEModelOutput

    return MoEModelOutput(last_hidden_state=hidden)


def hidden_size(model: Any) -> int:
    """The width of the encoder's output: its config's ``d_model`` or ``hidden_size``, read
    from the encoder's own config where the model nests one (T5Gemma's, EncoderDecoderModel's
    ``config.encoder``; T5Gemma 2's ``config.encoder.text_config``)."""
    encoder = getattr(model.config, "encoder", None)
    for cfg in (model.config, encoder, getattr(encoder, "text_config", None)):
        width = getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size", None)
        if isinstance(width, int):
            return width
    raise ValueError(f"{type(model.config).__name__} names no width of its encoder's output "
                     "(d_model, hidden_size, encoder.hidden_size, encoder.text_config.hidden_size)")


class EncoderWithCross(torch.nn.Module):
    """The encoder and the decoder's cross-attention cache of its output: (input, mask) ->
    (last_hidden_state, [cross k0, v0, k1, v1, ...]). The cache is what the model's own
    cross-attention layers store on their first call (the decoder's token path feeds no
    output, so the exported graph holds only the key and value projections)."""

    def __init__(self, model: torch.nn.Module, start: int) -> None:
        super().__init__()
        self.model = model
        self.start = start
        self.main = main_input(model)

    def forward(self, features: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        kw: dict[str, Any] = {self.main: features}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        hidden = self.model.get_encoder()(**kw).last_hidden_state
        first = torch.full((features.shape[0], 1), self.start, dtype=torch.long,
                           device=features.device)
        out = self.model(decoder_input_ids=first, encoder_outputs=encoder_outputs(hidden),
                         attention_mask=attention_mask, use_cache=True)
        return hidden, split_cache(out.past_key_values)[1]


class DecoderWithPast(torch.nn.Module):
    """One decoder step: (input_ids, encoder_attention_mask, [dec k0, dec v0, enc k0, enc v0,
    ...]) -> (logits, [present dec k0, v0, ...]). The encoder output is not an input: the
    cross-attention layers read the cache (a placeholder of the encoder output's shape tells
    the model that cross-attention runs; no value of it is read)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.hidden = hidden_size(model)

    def forward(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor | None,
                past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        from transformers import DynamicCache, EncoderDecoderCache

        if encoder_attention_mask is not None:
            torch._check(encoder_attention_mask.shape[1] == past[2].shape[2],
                         lambda: CROSS_RULE)
        selfs = [(past[i], past[i + 1]) for i in range(0, len(past), 4)]
        cross = [(past[i + 2], past[i + 3]) for i in range(0, len(past), 4)]
        cache = EncoderDecoderCache(DynamicCache(selfs), DynamicCache(cross))
        placeholder = past[2].new_zeros(input_ids.shape[0], past[2].shape[2], self.hidden)
        # None (an audio model's) is the model's own default, as EncoderWithCross passes it
        out = self.model(decoder_input_ids=input_ids, attention_mask=encoder_attention_mask,
                         encoder_outputs=encoder_outputs(placeholder),
                         past_key_values=cache, use_cache=True)
        return out.logits, split_cache(out.past_key_values)[0]


class AudioDecoderWithPast(DecoderWithPast):
    """An audio encoder-decoder's step (Whisper): no encoder mask among the inputs - the
    encoder's output has a fixed length and no padding."""

    def forward(self, input_ids: torch.Tensor,  # type: ignore[override]
                past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return super().forward(input_ids, None, past)


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
    seqs = [torch.tensor(x, dtype=torch.long) for x in ids]
    return {"input_ids": pad_sequence(seqs, batch_first=True, padding_value=pad),
            "attention_mask": pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)}
