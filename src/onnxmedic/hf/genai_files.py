"""The side files of a generation package, a decoder's or an encoder-decoder's:
``genai_config.json`` (onnxruntime-genai's description of the graphs and its search defaults),
the model's ``config.json`` and ``generation_config.json``, the tokenizer's files and the
feature extractor's ``preprocessor_config.json``.

``genai_config.json`` follows what onnxruntime-genai's model builder writes
(``onnxruntime_genai/models/builders/base.py``, ``make_genai_config``): ``model.decoder``
names the graph file, its inputs and outputs (``%d`` for the layer), the heads and sizes;
``search`` holds greedy defaults. A decoder package's ``model.type`` is ``decoder``, GenAI's
generic decoder-only model (its model-specific types name the same class for the layouts
written here). Among encoder-decoders onnxruntime-genai (0.18) serves one model type,
``whisper`` (``builders/whisper.py`` writes it, its runtime's ``WhisperState`` runs it): an
encoder whose outputs are the hidden states and the cross-attention cache, a decoder with self
and cross caches - the layout of our package, so a Whisper package's config names our graphs'
inputs and outputs (optimum's names: genai reads them from the config). genai has no model
type for T5, BART, Marian or mBART: those packages have none (hf/seq2seq.py says so, OM825).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxmedic.genpackage import CROSS, KINDS, LOGITS, SELF, genai_pattern

logger = logging.getLogger(__name__)

CONFIG = "genai_config.json"
GENAI_TYPES = {"whisper": "whisper"}  # an encoder-decoder's model_type -> genai's model type


@dataclass
class Layout:
    """What an exported package's graphs are (hf/generation.py's one decoder graph, or
    hf/seq2seq.py's encoder and decoder graphs): what genai_config.json describes, and what
    the package's export and verification read of them."""

    decoder: str  # the decoder graph's file
    layers: int
    kv_heads: int  # the decoder cache's heads
    head_size: int
    position_ids: bool = False  # the decoder takes position_ids
    encoder: str | None = None  # an encoder-decoder's encoder graph file (None: a decoder)
    main: str = "input_ids"  # the encoder's main input (input_features: Whisper)
    start: int | None = None  # the decoder's first token
    programs: dict[str, Any] = field(default_factory=dict, repr=False)  # by graph


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value


def _token_ids(model: Any, tokenizer: Any) -> dict[str, Any]:
    """The BOS, EOS and pad ids: the generation config's, else the config's, else the
    tokenizer's; a missing pad id is the (first) EOS id or 0, a missing BOS or EOS id the pad
    id."""
    parts = (getattr(model, "generation_config", None), model.config, tokenizer)
    out = {key: next((getattr(x, key) for x in parts if getattr(x, key, None) is not None),
                     None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if out["pad_token_id"] is None:
        eos = out["eos_token_id"]
        out["pad_token_id"] = 0 if eos is None else _first(eos)
    for key in ("bos_token_id", "eos_token_id"):
        if out[key] is None:
            out[key] = out["pad_token_id"]
    return out


def _io(layout: Layout) -> tuple[dict[str, str], dict[str, str]]:
    """The decoder section's inputs and outputs: a decoder's (mask, position ids, one cache)
    or an encoder-decoder's (self-attention cache ``.decoder.``, cross cache ``.encoder.``),
    named by the package contract (genpackage.genai_pattern)."""
    part = SELF if layout.encoder is not None else None
    inputs = {"input_ids": "input_ids"}
    if layout.encoder is None:
        inputs["attention_mask"] = "attention_mask"
        if layout.position_ids:
            inputs["position_ids"] = "position_ids"
    inputs.update(_cache_names("past", part))
    if layout.encoder is not None:
        inputs.update(_cache_names("past", CROSS))
    return inputs, {"logits": LOGITS, **_cache_names("present", part)}


def _cache_names(io: str, part: str | None) -> dict[str, str]:
    """A cache's names in genai_config.json, ``io`` "past" (the decoder's inputs) or "present"
    (its outputs; the encoder's for the cross-attention cache, ``part`` CROSS, whose keys are
    ``cross_``-prefixed)."""
    prefix = "cross_" if part == CROSS else ""
    return {f"{prefix}{io}_{kind}_names": genai_pattern(kind, part, present=io == "present")
            for kind in KINDS}


def genai_config(model: Any, tokenizer: Any, layout: Layout) -> dict[str, Any]:
    """The genai_config.json dict for the package ``layout``: model type ``decoder``, or the
    encoder-decoder's (GENAI_TYPES) with its encoder section."""
    cfg = model.config
    ctx = getattr(cfg, "max_position_embeddings", None) or 2048
    heads = getattr(cfg, "num_attention_heads", None) or layout.kv_heads
    inputs, outputs = _io(layout)
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": layout.decoder,
        "head_size": layout.head_size,
        "hidden_size": getattr(cfg, "hidden_size", None) or layout.head_size * heads,
        "inputs": inputs,
        "outputs": outputs,
        "num_attention_heads": heads,
        "num_hidden_layers": layout.layers,
        "num_key_value_heads": layout.kv_heads,
    }
    ids = _token_ids(model, tokenizer)
    out = {
        "model": {"bos_token_id": ids["bos_token_id"], "context_length": int(ctx),
                  "decoder": decoder, "eos_token_id": ids["eos_token_id"],
                  "pad_token_id": ids["pad_token_id"], "type": "decoder",
                  "vocab_size": int(cfg.vocab_size)},
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
                   "length_penalty": 1.0, "max_length": int(ctx), "min_length": 0,
                   "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
                   "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }
    if layout.encoder is None:
        return out
    # an encoder-decoder (Whisper's model type): the decoder's sizes from its own config
    # fields, the encoder's section, the context of the decoder
    decoder["hidden_size"] = int(cfg.d_model)
    decoder["num_attention_heads"] = int(cfg.decoder_attention_heads)
    heads = int(cfg.encoder_attention_heads)
    encoder = {"session_options": dict(decoder["session_options"]), "filename": layout.encoder,
               "head_size": int(cfg.d_model) // heads, "hidden_size": int(cfg.d_model),
               "inputs": {"audio_features": layout.main},
               "outputs": {"encoder_hidden_states": "last_hidden_state",
                           **_cache_names("present", CROSS)},
               "num_attention_heads": heads, "num_hidden_layers": int(cfg.encoder_layers),
               "num_key_value_heads": heads}
    model_part = out["model"]
    model_part.update(type=GENAI_TYPES[cfg.model_type], encoder=encoder,
                      context_length=int(getattr(cfg, "max_target_positions", 448)),
                      bos_token_id=layout.start)
    out["search"]["max_length"] = model_part["context_length"]
    return out


def write_side_files(model: Any, tokenizer: Any, folder: Path, layout: Layout | None = None,
                     processor: Any = None) -> list[str]:
    """Write genai_config.json (where ``layout`` is given), config.json,
    generation_config.json, the tokenizer's and the feature extractor's (``processor``) files
    into ``folder``; returns the names the folder holds."""
    folder = Path(folder)
    if layout is not None:
        (folder / CONFIG).write_text(
            json.dumps(genai_config(model, tokenizer, layout), indent=2) + "\n")
    for part in (model.config, getattr(model, "generation_config", None), tokenizer, processor):
        if part is not None:
            part.save_pretrained(folder)
    return sorted(p.name for p in folder.iterdir())
